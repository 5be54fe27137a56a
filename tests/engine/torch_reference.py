"""The same Llama-family decoder written directly in PyTorch, as the outside reference."""

import numpy as np
import torch


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class TorchLlama(torch.nn.Module):
    def __init__(self, config, state_dict, dtype=torch.float32):
        super().__init__()
        self.config = config
        self.params = torch.nn.ParameterDict()
        self.names = list(state_dict)
        for name, value in state_dict.items():
            self.params[name.replace(".", "__")] = torch.nn.Parameter(
                torch.tensor(np.asarray(value), dtype=dtype))
        D = config.head_dimension
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        angles = torch.outer(torch.arange(config.maximum_context, dtype=torch.float64), inv_freq)
        emb = torch.cat([angles, angles], dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def p(self, name):
        return self.params[name.replace(".", "__")]

    def rmsnorm(self, x, weight):
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.config.norm_epsilon) * weight

    def hidden(self, tokens):
        cfg = self.config
        B, T = tokens.shape
        H, KV, D = cfg.head_count, cfg.kv_heads, cfg.head_dimension
        x = self.p("model.embed_tokens.weight")[tokens]
        cos, sin = self.cos[:T], self.sin[:T]
        mask = torch.full((T, T), float("-inf")).triu(1)
        for i in range(cfg.block_count):
            pre = f"model.layers.{i}."
            h = self.rmsnorm(x, self.p(pre + "input_layernorm.weight"))
            q = (h @ self.p(pre + "self_attn.q_proj.weight").T).view(B, T, H, D).transpose(1, 2)
            k = (h @ self.p(pre + "self_attn.k_proj.weight").T).view(B, T, KV, D).transpose(1, 2)
            v = (h @ self.p(pre + "self_attn.v_proj.weight").T).view(B, T, KV, D).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k = k.repeat_interleave(H // KV, dim=1)
            v = v.repeat_interleave(H // KV, dim=1)
            scores = q @ k.transpose(-1, -2) / np.sqrt(D) + mask
            att = torch.softmax(scores, dim=-1) @ v
            att = att.transpose(1, 2).reshape(B, T, H * D)
            x = x + att @ self.p(pre + "self_attn.o_proj.weight").T
            h = self.rmsnorm(x, self.p(pre + "post_attention_layernorm.weight"))
            gate = h @ self.p(pre + "mlp.gate_proj.weight").T
            up = h @ self.p(pre + "mlp.up_proj.weight").T
            x = x + (torch.nn.functional.silu(gate) * up) @ self.p(pre + "mlp.down_proj.weight").T
        return self.rmsnorm(x, self.p("model.norm.weight"))

    def logits(self, tokens):
        head = "model.embed_tokens.weight" if self.config.tie_embeddings else "lm_head.weight"
        return self.hidden(tokens) @ self.p(head).T

    def loss(self, inputs, targets):
        logits = self.logits(inputs)
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)

    def grads(self):
        return {name: self.p(name).grad.detach().numpy().copy() for name in self.names}
