"""Log-probs of a left-padded batch under each CUDA SDPA backend: finite, and equal to each prompt's
own unpadded pass. The update's prompt pass left-pads prompts of unequal lengths; a padding position
attends to itself only (lib/policy.py, logprobs_pass), since some CUDA kernels return NaN for a query row
with no allowed key, which a CPU (zeros there) cannot show. Without CUDA this says so and exits 0
(--device cpu runs the same comparison on the CPU's one backend, to check the script itself).

    python .ci/padded_logprobs.py            # exit 1 if any available backend gives NaN or differs
"""

import sys
import tempfile
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
import data  # noqa: E402
import sampler  # noqa: E402
from lib import logprobs, step  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # bf16: different padding changes the kernels' tiling


def tiny_model(device):
    """A random 2-layer Qwen2 with the embedded tokenizer, on `device`, fp32 weights."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
    tok = data.build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with tempfile.TemporaryDirectory() as path:  # loaded back as brorl loads a policy: attention "brorl"
        Qwen2ForCausalLM(cfg).save_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="brorl")
    return model.to(device).eval(), tok


def main():
    device = torch.device("cpu" if "--device" in sys.argv and sys.argv[-1] == "cpu" else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("padded log-probs: skipped, no CUDA device (the check is of CUDA's SDPA kernels)")
        return 0
    model, tok = tiny_model(device)
    prompts = ["123+45=", "9+1=", "77+123+1+450=", "5"]  # unequal lengths: up to 10 padding positions
    ro = sampler.generate(model, tok, prompts, 3, 8, 1.0, 1.0, 4096, [1, 2, 3, 4])
    batch = step.pack_groups([ro.group(g) for g in range(len(prompts))], device)
    alone = [step.pack_groups([ro.group(g)], device) for g in range(len(prompts))]  # no padding
    backends = ([SDPBackend.MATH] if device.type == "cpu" else
                [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION])
    failed = False
    for dtype in (torch.float32, torch.bfloat16):
        for backend in backends:
            try:
                with sdpa_kernel([backend]), torch.no_grad(), torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
                    padded = logprobs.response_logprobs(model, batch, torch.arange(len(ro.texts), device=device), 1.0)
                    own = [logprobs.response_logprobs(model, b, torch.arange(3, device=device), 1.0) for b in alone]
            except RuntimeError as e:  # e.g. flash attention takes no arbitrary mask: not available here
                print(f"{str(dtype):15s} {backend.name:20s} not available for these masks ({str(e).splitlines()[0][:80]})")
                continue
            T = min(padded.shape[1], *(o.shape[1] for o in own))
            err = max((padded[3 * g: 3 * g + 3, :T] - o[:, :T]).abs().max().item() for g, o in enumerate(own))
            finite = bool(torch.isfinite(padded).all())
            ok = finite and err <= TOL[dtype]
            failed |= not ok
            print(f"{str(dtype):15s} {backend.name:20s} finite {finite}, max |padded - alone| {err:.2e} "
                  f"(tolerance {TOL[dtype]:g}): {'ok' if ok else 'FAIL'}")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
