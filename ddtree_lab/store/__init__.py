"""The lab's file containers, below every reader: the checksummed one-document container, the append-only segment file, and the one tensor checksum they store (``checksums``)."""
