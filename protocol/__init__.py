"""The wire vocabulary: typed, versioned msgpack messages and the values they carry (sampling
parameters, prefix-cache hashes, block arithmetic, choice keys). No sockets, threads or torch
here: the sockets and the loop around them are ``pdserve.runtime``'s."""

from pdserve.protocol import messages  # noqa: F401  (importing it registers every message type)
