"""Training data: readers that normalise every corpus to one record shape (`sources`), mixtures of
sources (`mix`), and the chat-template encoding with its assistant loss mask (`chat`).

A record is ``{"id": str, "source": str, "conversations": [{"role", "content"}, ...]}`` with roles
``system`` (optional, first), then ``user`` and ``assistant`` alternating, starting with ``user``.
"""
