"""Environment variables the control plane sets for a worker it starts (both halves name them from here)."""

PARENT_ENV = "EAGLE3_DIE_WITH_PARENT"  # the pid of a starter the worker must not outlive (the local host)
NO_BAR_ENV = "EAGLE3_NO_BAR"  # "1": no terminal progress bar (the SSH host's jobs: nobody watches their stderr)
