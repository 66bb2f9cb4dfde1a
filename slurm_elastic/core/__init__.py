"""The pure policy core: no I/O, no clock reads, stdlib only. Time is passed in as ``now_s``."""
