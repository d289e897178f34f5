"""Pure math: advantage estimators, the EB prior, group statistics, the loss menu, the curriculum
samplers. Tensors and numbers in, tensors out: nothing here imports a model, a file or the
config object (tests/test_import_layers.py).
"""
