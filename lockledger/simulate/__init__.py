"""The fleet simulator behind `lockledger simulate`: simulated AGVs run pallet-to-zone sagas, and drive
reserved routes and hand pallets to forklifts, against a running server through the SDK, with crashes and
lost answers, and check the lock invariants as they go.

It is not part of the SDK's own distribution (an agent does not need it): the server's distribution
carries it, with its command (``lockledger.simulate.cli``). ``fleet`` runs the AGVs, ``faults`` is the
network under each, ``ledger`` checks every grant.
"""

from lockledger.simulate.fleet import Settings, Simulation, Summary

__all__ = ["Settings", "Simulation", "Summary"]
