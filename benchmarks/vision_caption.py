"""Captioning speed: rows/s of our engine and of transformers' batched generate on the same
vision-language checkpoint, and the vision tower's share of our time. One process, one thread count.

    python -m benchmarks.vision_caption DIR [--images 200] [--new 16] [--batch 32]
    python -m benchmarks.vision_caption --make /tmp/vl [--kind qwen2_vl]   # a tiny random checkpoint, then run

Each row: one image (random noise, 28-112 px a side, a fixed seed) and "Describe this image."; greedy,
`--new` tokens each (no end of sequence). Ours: preprocessing (engine/vision/processor.py), the chat
template and the engine, from PIL images to tokens. transformers: the same pixel values and token ids
(our preprocessing is exact against its processor: tests/test_vision_models.py), left-padded batches
of `--batch` through `generate`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

PROMPT = "Describe this image."


def images(n: int):
    from PIL import Image
    g = np.random.default_rng(0)
    return [Image.fromarray(g.integers(0, 256, (int(g.integers(28, 113)), int(g.integers(28, 113)), 3), np.uint8))
            for _ in range(n)]


def ours(path: str, pics, new: int) -> tuple[float, float, list]:
    """(rows/s, the tower's share of the time, the requests) from PIL images to generated tokens."""
    from jobrunner.engine import Engine, EngineConfig, ImageInput, Request, SamplingParams, image_key
    eng = Engine(EngineConfig(model=path, device="cpu", dtype="float32"))
    tower_s = [0.0]
    encode = eng.rt.model.encode_images

    def timed(pixels, grids):
        t = time.perf_counter()
        out = encode(pixels, grids)
        tower_s[0] += time.perf_counter() - t
        return out
    eng.rt.model.encode_images = timed
    proc, tok = eng.image_processor, eng.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}])
    base = tok.encode(text)

    def requests(batch):
        out = []
        for i, pic in enumerate(batch):
            p = proc.prepare(pic)
            ids, [offset] = proc.expand(base, [p])
            out.append(Request(str(i), ids, SamplingParams(max_tokens=new, ignore_eos=True),
                               images=(ImageInput(p.pixels, p.grid, image_key(p), offset, p.num_tokens),)))
        return out
    eng.generate(requests(pics[:2]))                              # warm-up
    eng.runner.image_embeds = type(eng.runner.image_embeds)(eng.rt.model, eng.runner.device)   # an empty store
    tower_s[0] = 0.0
    t0 = time.perf_counter()
    reqs = requests(pics)
    eng.generate(reqs)
    dt = time.perf_counter() - t0
    eng.close()
    return len(pics) / dt, tower_s[0] / dt, reqs


def transformers_rate(path: str, reqs, new: int, batch: int, kind: str) -> float:
    import transformers
    cls = (transformers.LlavaForConditionalGeneration if kind == "llava"
           else transformers.AutoModelForImageTextToText)
    hf = cls.from_pretrained(path, dtype=torch.float32).eval()

    def run(rows):
        width = max(len(r.prompt_token_ids) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        types = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, r in enumerate(rows):            # left padding, as batched generation needs
            pad = width - len(r.prompt_token_ids)
            ids[i, pad:] = torch.tensor(r.prompt_token_ids)
            mask[i, pad:] = 1
            im = r.images[0]
            types[i, pad + im.offset:pad + im.offset + im.length] = 1
        extra = ({"pixel_values": torch.from_numpy(np.stack([r.images[0].pixels for r in rows]))} if kind == "llava"
                 else {"pixel_values": torch.from_numpy(np.concatenate([r.images[0].pixels for r in rows])),
                       "image_grid_thw": torch.tensor([r.images[0].grid for r in rows]), "mm_token_type_ids": types})
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, **extra, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0)
    run(reqs[:2])                                                   # warm-up
    t0 = time.perf_counter()
    for lo in range(0, len(reqs), batch):
        run(reqs[lo:lo + batch])
    return len(reqs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--make", help="save a tiny random checkpoint here first (tests/vision_checkpoints.py)")
    ap.add_argument("--kind", default="qwen2_vl")
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    path = a.dir
    if a.make:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from vision_checkpoints import checkpoint
        path = str(checkpoint(a.kind, Path(a.make))[0])
    kind = "llava" if "llava" in Path(path).name else a.kind
    pics = images(a.images)
    rate, tower, reqs = ours(path, pics, a.new)
    hf = transformers_rate(path, reqs, a.new, a.batch, kind)
    print(f"threads {torch.get_num_threads()}, {a.images} images x {a.new} new tokens, transformers batch {a.batch}")
    print(f"ours {rate:.1f} rows/s (vision tower {tower:.0%} of the time), transformers {hf:.1f} rows/s, "
          f"ours/transformers {rate / hf:.2f}x rows/s")


if __name__ == "__main__":
    main()
