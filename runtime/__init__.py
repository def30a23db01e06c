"""What every role runs its messages on: ZMQ sockets (``sockets``), CURVE keys and secured
contexts (``security``) and their key files with each identity's roles (``keyfiles``), the check
of a sender's roles at each receiver (``gate``), the recv → step → send loop and its outbox
(``loop``), a worker's heartbeat thread (``liveness``). It speaks ``pdserve.protocol``'s
messages; no torch here."""
