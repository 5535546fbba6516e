"""Generate examples/prompts.jsonl: a deterministic, synthetic but realistic offline-generation prompt sample.

Rows mix plain ``prompt`` strings and chat ``messages`` (system + user, some with a prior turn), with prompt
lengths of ~100-600 tokens at ~4 characters per token. Run: ``python examples/make_prompts.py [--rows 400]``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TASKS = [
    "Write a detailed, step-by-step solution to the following problem, explaining each step.",
    "Summarise the following document for an engineering audience, keeping every number.",
    "Rewrite the following passage as clear technical documentation with headings.",
    "Answer the question below, then list the assumptions your answer depends on.",
    "Review the following code description and point out bugs, risks and missing tests.",
    "Translate the following notes into a structured project plan with milestones.",
    "Write a short story that continues the scene below, in the same voice.",
    "Explain the following concept to a first-year student, with two worked examples.",
]
SUBJECTS = [
    "a distributed key-value store", "a GPU memory allocator", "a speculative decoding drafter", "a rolling restart",
    "a bicycle-sharing network", "a hospital scheduling system", "a weather forecasting pipeline", "a compiler pass",
    "a photosynthesis experiment", "a medieval trade route", "a chess endgame", "an inventory forecast",
    "a mobile banking app", "a solar farm", "a recommendation model", "a railway timetable",
]
CLAUSES = [
    "the team measured the latency at the 99th percentile over a week of traffic",
    "each component reports its own memory usage and the totals rarely agree",
    "the budget was fixed in advance, so every change had to pay for itself",
    "an earlier attempt failed because the cache was sized from total rather than free memory",
    "the operators restart the service every night and the first hour is always slower",
    "two of the inputs arrive late, and the output must still be complete by morning",
    "the original author left a note saying the constant was chosen by trial and error",
    "the results were reproduced on three machines with slightly different drivers",
    "throughput doubled once the batch size stopped being limited by a hidden cap",
    "the documentation describes a flag that was renamed in the previous release",
    "a small fraction of requests produce outputs ten times longer than the median",
    "the acceptance rate of the draft model drops sharply on code and tables",
    "nobody is sure whether the warm-up phase should be included in the measurement",
    "the configuration file uses dashes while the code uses underscores",
    "the shared memory segments left behind slowly filled the host's RAM",
    "the customer asked for a plain explanation without jargon",
]
QUESTIONS = [
    "What is the most likely bottleneck, and how would you confirm it?",
    "Which two changes would you try first, and why?",
    "What could go wrong if this were run unattended for two days?",
    "How would you explain the trade-off to a manager in three sentences?",
    "What measurements are missing to make a decision?",
]


def _passage(rng: random.Random, target_chars: int) -> str:
    subject = rng.choice(SUBJECTS)
    sentences = [f"This concerns {subject}."]
    while sum(len(s) + 1 for s in sentences) < target_chars:
        clause = rng.choice(CLAUSES)
        lead = rng.choice(["In practice,", "Notably,", "Meanwhile,", "However,", "As a result,", "In one case,"])
        sentences.append(f"{lead} {clause}, which matters for {rng.choice(SUBJECTS)}.")
    return " ".join(sentences)


def make_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        tokens = int(rng.triangular(100, 600, 250))
        body = _passage(rng, tokens * 4 - 120)
        task = rng.choice(TASKS)
        question = rng.choice(QUESTIONS)
        kind = i % 3
        if kind == 0:
            row: dict = {"prompt": f"{task}\n\n{body}\n\n{question}"}
        else:
            messages = [{"role": "system", "content": "You are a careful, thorough assistant."}]
            if kind == 2:
                messages += [
                    {"role": "user", "content": f"Here is some background. {body[: len(body) // 3]}"},
                    {"role": "assistant", "content": "Understood. What would you like me to do with it?"},
                ]
                body = body[len(body) // 3 :]
            messages.append({"role": "user", "content": f"{task}\n\n{body}\n\n{question}"})
            row = {"messages": messages}
        if rng.random() < 0.25:
            row["max_tokens"] = rng.choice([512, 1024, 2048])
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("prompts.jsonl"))
    args = parser.parse_args()
    rows = make_rows(args.rows, args.seed)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
