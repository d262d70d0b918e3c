def load_pretrained_config(hf_config=None):
    """NxDI returns a function that copies the HF config's attributes onto the InferenceConfig."""

    def load(config):
        for key, value in hf_config.to_dict().items():
            setattr(config, key, value)

    return load
