"""The backbone families: GPTAlpha-2 (the paper's), Llama (Qwen, Mistral) and Gemma, and their base
class."""
