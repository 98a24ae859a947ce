"""The lab's file containers, below every reader: the checksummed one-document container and the append-only segment file."""
