"""Training data: readers that normalise every corpus to one record shape (`sources`; the English
filter: `english`; hub data sets: `hub`), mixtures of sources (`mix`), and the chat-template
encoding with its assistant loss mask (`chat`); the target's own answers (`regenerate`, or through
a server: `regenerate_http`), and its features (`features`).

A record is ``{"id": str, "source": str, "conversations": [{"role", "content"}, ...]}`` with roles
``system`` (optional, first), then ``user`` and ``assistant`` alternating, starting with ``user``.
"""
