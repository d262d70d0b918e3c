import torch


class MoENeuronConfig:
    def __init__(self, tp_degree=1, torch_dtype=torch.bfloat16, **kwargs):
        self.tp_degree = tp_degree
        self.torch_dtype = torch_dtype
        self.__dict__.update(kwargs)


class InferenceConfig:
    def __init__(self, neuron_config, load_config=None, **kwargs):
        self.neuron_config = neuron_config
        if load_config is not None:
            load_config(self)
        self.__dict__.update(kwargs)
