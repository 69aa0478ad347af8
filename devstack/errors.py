"""The one error the embedded server raises: its message is a single line that says what to do."""


class EmbeddedTritonError(RuntimeError):
    pass
