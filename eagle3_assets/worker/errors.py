class StageError(Exception):
    """A problem with the stage's input that the user must fix; its message says what and how."""
