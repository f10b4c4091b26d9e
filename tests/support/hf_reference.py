"""The reference the tests hold Tandem to: transformers on the same weights (float32)."""

from __future__ import annotations


class HFReference:
    """Greedy generation and log-probs from transformers on the same weights (float32)."""

    def __init__(self, path: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self._cache: dict[tuple, list[int]] = {}

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation; stops at EOS like the server does (EOS included)."""
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._cache:
            with self.torch.inference_mode():
                out = self.model.generate(
                    self.torch.tensor([prompt_ids]),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=self.tokenizer.eos_token_id,
                )
            self._cache[key] = out[0, len(prompt_ids) :].tolist()
        return self._cache[key]

    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float]:
        """log p(token i | tokens < i) for i >= 1."""
        with self.torch.inference_mode():
            logits = self.model(self.torch.tensor([prompt_ids])).logits[0].float()
        lp = self.torch.log_softmax(logits, dim=-1)
        return [lp[i - 1, prompt_ids[i]].item() for i in range(1, len(prompt_ids))]

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
