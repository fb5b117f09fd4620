"""The systems the same workload is driven against; each module is one target."""
