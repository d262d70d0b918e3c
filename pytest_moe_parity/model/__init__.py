"""What recording and replay share about a transformers model: where each capture point lives
(`archs`), a safetensors checkpoint read without its tensor data (`checkpoint`: index, headers,
quantization), the model loaded one unit at a time (`lazy_model`), module calls as hooks see them
(`calls`: the KV cache a call takes and by which keyword, a point's output tensors, whole-model
output capture, and a golden's KV cache made live for a candidate's call) and eager attention run a
block of query rows at a time for long prompts (`attention`)."""
