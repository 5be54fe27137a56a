"""Closeable: the context-manager lifetime (enter, exit, close, use after close refused) of engine objects that own buffers."""


class Closeable:
    """A `with` block closes the object; `_check_open` refuses use afterwards."""

    _closed = False
    closed_message = "the object has been closed"  # what a use after close() raises

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False

    def close(self):
        """Mark the object closed; subclasses release their buffers and call this."""
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self):
        if self._closed:
            raise RuntimeError(self.closed_message)
