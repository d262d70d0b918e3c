"""build_module as documented: example_inputs is a list holding exactly one tuple of tensors; the
module is module_cls(**module_init_kwargs) with the checkpoint's weights (strictly); the returned
callable takes positional tensors of the traced shapes and dtypes only (static shapes)."""

import torch

CALLS = []  # what was built, for the tests


def build_module(
    module_cls,
    example_inputs,
    module_init_kwargs=None,
    tp_degree=1,
    world_size=None,
    local_ranks_size=None,
    compiler_args=None,
    compiler_workdir=None,
    checkpoint_path=None,
    priority_model_idx=0,
    logical_nc_config=1,
    dry_run=False,
    checkpoint_loader_fn=torch.load,
):
    if not isinstance(example_inputs, list) or len(example_inputs) != 1 or not isinstance(example_inputs[0], tuple):
        raise TypeError("example_inputs must be a list with exactly one tuple of tensors")
    if not all(isinstance(t, torch.Tensor) for t in example_inputs[0]):
        raise TypeError("example_inputs: positional tensors only")
    if not isinstance(tp_degree, int) or tp_degree < 1:
        raise ValueError(f"tp_degree must be a positive int, got {tp_degree!r}")
    module_init_kwargs = {} if module_init_kwargs is None else module_init_kwargs
    if not isinstance(module_init_kwargs, dict):
        raise TypeError("module_init_kwargs must be a dict")
    module = module_cls(**module_init_kwargs)
    if checkpoint_path is not None:
        module.load_state_dict(checkpoint_loader_fn(checkpoint_path), strict=True)
    module.eval()
    signature = [(t.shape, t.dtype) for t in example_inputs[0]]
    CALLS.append(
        {
            "cls": module_cls.__name__,
            "tp_degree": tp_degree,
            "signature": signature,
            "kwargs": sorted(module_init_kwargs),
            "workdir": compiler_workdir,
        }
    )

    def traced(*args):
        if [(t.shape, t.dtype) for t in args] != signature:
            raise RuntimeError(f"a traced module takes {signature}, got {[(t.shape, t.dtype) for t in args]}")
        with torch.no_grad():
            return module(*args)

    return traced
