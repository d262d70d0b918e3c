"""NxDI's application base as documented (models/application_base.py, release 2.29): the quantized
checkpoint NxDI writes for `neuron_config.quantized=True` (`save_quantized_state_dict`: the HF model
loaded by `load_hf_model`, quantized by NxD as `quantization_type` and `quantization_dtype` say,
`prepare_quantized_state_dict`'s state dict of its base model plus `lm_head.*`, saved with torch.save
to `quantized_checkpoints_path`)."""

import torch
from neuronx_distributed.quantization.quantization_config import QuantizationType, QuantizedDtype
from neuronx_distributed.quantization.quantization_utils import (
    convert_qint8_to_int8_state_dict,
    quantize_pytorch_model_per_channel_symmetric,
)


class NeuronApplicationBase:
    @staticmethod
    def load_hf_model(model_path):
        raise NotImplementedError("load_hf_model is not implemented")

    @classmethod
    def save_quantized_state_dict(cls, model_path, config):
        state = cls.generate_quantized_state_dict(model_path, config)
        torch.save({k: v for k, v in state.items() if v is not None}, config.neuron_config.quantized_checkpoints_path)

    @classmethod
    def generate_quantized_state_dict(cls, model_path, config):
        hf_model = cls.load_hf_model(model_path)
        kind = QuantizationType(config.neuron_config.quantization_type)
        dtype = QuantizedDtype.get_dtype(config.neuron_config.quantization_dtype)
        if kind != QuantizationType.PER_CHANNEL_SYMMETRIC:
            raise RuntimeError(f"{config.neuron_config.quantization_type} not supported")
        quantized = quantize_pytorch_model_per_channel_symmetric(
            hf_model, inplace=True, dtype=dtype,
            modules_to_not_convert=getattr(config.neuron_config, "modules_to_not_convert", None),
        )  # fmt: skip
        return cls.prepare_quantized_state_dict(quantized)

    @classmethod
    def prepare_quantized_state_dict(cls, hf_model_quant):
        state = hf_model_quant.model.state_dict()
        head = hf_model_quant.lm_head.state_dict()
        convert_qint8_to_int8_state_dict(state)
        convert_qint8_to_int8_state_dict(head)
        state.update({f"lm_head.{k}": v for k, v in head.items()})
        return state
