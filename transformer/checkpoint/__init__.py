"""Checkpoints: orbax wiring and checksums, averaging, fault injection, the workdir."""
