"""Cross-process messages (typed, versioned msgpack) and small ZMQ helpers; no torch here."""

from pdserve.protocol import messages  # noqa: F401  (importing it registers every message type)
