"""Each post-training algorithm's format-neutral part, written once for both front-ends: the rules, the
arithmetic on numpy arrays (or torch tensors as a math library, for the learned rounding), the records.
Nothing here captures a torch model, reads an ONNX graph or imports a front-end (``quantize``'s pt2e
modules, ``quantize_onnx``): the front-ends find the layers, run the models and call these.
"""
