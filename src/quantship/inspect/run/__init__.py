"""Running a file: ONNX Runtime sessions, the consumers' runtimes, and their outputs measured in LSB.

Above ``read`` (a run reads the file's inputs and output scales) and below ``judge``: nothing here
knows a target's rules or tolerance.
"""
