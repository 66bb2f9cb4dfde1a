"""Slurm prolog/epilog hooks for cluster admins (run as root by slurmd; see docs/admin.md)."""
