"""Generate the self-calibration text shipped as exl3_jax/data/calibration_generated.txt.

Usage: python scripts/make_calibration.py [--source DIR] [--out PATH] [--new-tokens 320]
                                          [--samples 2] [--batch 16]

The default model's Hessians need several thousand tokens per 1536-wide input (down_proj) to be
well conditioned; the hand-written calibration.txt has about 1.6k. More text is made by the
unquantized source model itself: it answers the fixed, varied instructions below, ``--samples``
times each (sampled at temperature 0.8, top-p 0.95, fixed seeds), so the activations it sees are
the ones the model produces in use. The answers are the model's own and not checked for facts. Each passage is stored in the chat template with a blank line between passages,
as calibration.txt is. The output is reproducible for a given backend and jax version, and it is
shipped, so builds never depend on running this.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from exl3_jax.generate import Generator, SamplingParams
from exl3_jax.models import load_model
from exl3_jax.quant import default_model as dm
from exl3_jax.tokenizer import Tokenizer

INSTRUCTIONS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What were the main causes of the French Revolution?",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Describe the water cycle to a ten-year-old.",
    "Give me five tips for learning a new language.",
    "How do vaccines train the immune system?",
    "Write a polite email asking a landlord to repair a leaking tap.",
    "Compare the climates of Norway and Egypt.",
    "What is the difference between weather and climate?",
    "Solve step by step: a train travels 180 km in 2.5 hours. What is its average speed?",
    "Write a poem about autumn leaves.",
    "Explain what a black hole is.",
    "List the planets of the solar system with one fact about each.",
    "How does a bill become a law in a parliamentary democracy?",
    "Write a recipe for a simple vegetable soup.",
    "What is photosynthesis and why does it matter for life on Earth?",
    "Explain recursion in programming with an example in JavaScript.",
    "Summarize the plot of a classic adventure novel of your choice.",
    "What are the benefits and risks of social media for teenagers?",
    "Describe how the printing press changed Europe.",
    "Write a dialogue between a customer and a baker.",
    "How do electric cars work, and how are they different from petrol cars?",
    "Explain the Pythagorean theorem and give a worked example.",
    "What should I pack for a week of hiking in the mountains?",
    "Tell me about the history of the Olympic Games.",
    "Write a SQL query that finds the ten customers with the largest total orders, and explain it.",
    "Why is the sky blue?",
    "Describe a busy market in a large city, using all five senses.",
    "What is inflation and how do central banks respond to it?",
    "Write a thank-you note to a teacher.",
    "Explain how the heart pumps blood through the body.",
    "Give an overview of the Roman Empire's rise and fall.",
    "How do I make a budget for a student living away from home?",
    "Write a limerick about a cat who loves to sleep.",
    "What are prime numbers? List the first fifteen and explain how to test a number.",
    "Explain how the internet sends a message from one computer to another.",
    "Describe the life cycle of a butterfly.",
    "What is the role of bees in agriculture?",
    "Write a short speech for the opening of a new public library.",
    "Explain the rules of chess briefly.",
    "How did ancient Egyptians build the pyramids, according to historians?",
    "Write a C function that reverses a linked list, with comments.",
    "What are the symptoms of dehydration and how can it be prevented?",
    "Describe the difference between a virus and a bacterium.",
    "Write a fairy tale that begins with a talking fox.",
    "What is machine learning? Explain it without jargon.",
    "How do tides work?",
    "Give advice to someone preparing for a job interview.",
    "Explain supply and demand with an example from a farmers' market.",
    "What happened during the first Moon landing?",
    "Translate into plain English: 'The aforementioned party shall indemnify the lessor.'",
    "Write a product description for a waterproof backpack.",
    "Explain why the seasons change during the year.",
    "What is a healthy breakfast, and why?",
    "Describe the structure of an atom.",
    "Write a letter from a sailor to his family in the year 1850.",
    "How does a compass work?",
    "What are some good habits for better sleep?",
    "Explain what DNA is and how it carries information.",
    "Write a bash script that counts the lines in every .txt file in a folder.",
    "Describe the painting style of the Impressionists.",
    "Why do we have leap years?",
    "Tell a story about a village that forgot how to laugh.",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", default=None, help="unquantized HF-layout SmolLM2 directory")
    ap.add_argument("--out", default=str(dm.DATA_DIR / "calibration_generated.txt"))
    ap.add_argument("--new-tokens", type=int, default=320)
    ap.add_argument("--samples", type=int, default=2, help="answers per instruction")
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()

    source = Path(a.source) if a.source else dm.source_model()
    tok = Tokenizer.from_dir(source)
    gen = Generator(load_model(source, dtype="float32", cache_dequantized=True))
    sampling = SamplingParams(temperature=0.8, top_p=0.95)
    passages = []
    for sample in range(a.samples):
        for lo in range(0, len(INSTRUCTIONS), a.batch):
            chunk = INSTRUCTIONS[lo:lo + a.batch]
            prompts = [tok.encode(tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True)) for q in chunk]
            out = gen.generate(prompts, max_new_tokens=a.new_tokens, sampling=sampling,
                               seed=1000 * sample + lo)
            for q, ids in zip(chunk, out.tokens):
                answer = tok.decode(ids).strip()
                passages.append(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                                f"{answer}<|im_end|>")
            print(f"{len(passages)}/{a.samples * len(INSTRUCTIONS)} passages", flush=True)
    Path(a.out).write_text("\n\n".join(passages) + "\n", encoding="utf-8")
    n = len(tok.encode(Path(a.out).read_text(encoding="utf-8")))
    print(f"wrote {a.out}: {len(passages)} passages, {n} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
