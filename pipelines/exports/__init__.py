"""A fine-tuned transformers model in the formats the tools people deploy with load:

    pretrained/     save_pretrained (frontends/transformers.py), LoRA merged, the tokenizer
                    beside it: ``from_pretrained`` / ``AutoTokenizer.from_pretrained``
    adapter/        a LoRA case's PEFT adapter directory (peft_adapter.py):
                    ``peft.PeftModel.from_pretrained(base, "adapter")``
    model.gguf      a LLaMA or Qwen2 causal LM as llama.cpp's convert script writes it
                    (gguf_file.py): llama.cpp, and ``from_pretrained(..., gguf_file=...)``

Each is written by the library that owns its format (transformers, peft, gguf).
"""
