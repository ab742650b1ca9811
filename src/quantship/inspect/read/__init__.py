"""Reading a file: one load, one walk, and what it contains (``FileFacts``, counts, memory, the report).

The lowest of inspect's three jobs: it imports nothing from ``run`` or ``judge``.
"""
