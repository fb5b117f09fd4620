"""lockledger: the public face of the lock service (the `lockledger` CLI; the Python SDK comes next).

Importing this package pulls in no server dependency, so an agent can use the client alone.
"""

__version__ = "0.1.0"
