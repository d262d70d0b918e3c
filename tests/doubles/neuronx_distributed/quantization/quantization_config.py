"""NxD's quantization settings as documented (quantization/quantization_config.py): the types a
NeuronConfig's `quantization_type` names and the dtypes its `quantization_dtype` names."""

from enum import Enum

import torch


class QuantizationType(Enum):
    PER_TENSOR_SYMMETRIC = "per_tensor_symmetric"
    PER_CHANNEL_SYMMETRIC = "per_channel_symmetric"


class QuantizedDtype(Enum):
    INT8 = torch.int8
    F8E4M3 = torch.float8_e4m3fn

    @classmethod
    def get_dtype(cls, dtype_string: str) -> torch.dtype:
        assert dtype_string.upper() in cls.__members__, f"{dtype_string} is not a valid QuantizedDtype."
        return cls[dtype_string.upper()].value
