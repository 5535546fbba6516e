"""Generate the example prompt samples: deterministic, synthetic but realistic offline-generation jobs.

* ``examples/prompts.jsonl`` (default): rows mix plain ``prompt`` strings and chat ``messages`` (system + user,
  some with a prior turn), with prompt lengths of ~100-600 tokens at ~4 characters per token and no shared prefix
  beyond a short system line. Run: ``python examples/make_prompts.py [--rows 400]``.
* ``examples/prompts-shared-prefix.jsonl`` (``--shared-prefix``): the shape of a labelling or extraction job, where
  every request carries the same long system prompt (instructions and a rubric, ~2,000 tokens), then one of a few
  few-shot templates (~600 tokens of worked examples), then its own item (~100-250 tokens). SGLang's radix cache
  serves the shared part from KV instead of prefilling it again. Run:
  ``python examples/make_prompts.py --shared-prefix [--rows 100]``.
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


SHARED_PREFIX_TOKENS = 2000  # the system prompt every row shares
TEMPLATE_TOKENS = 600  # each few-shot template
TEMPLATES = 4
RUBRIC_RULES = [
    "Quote the exact sentence that supports each label you assign.",
    "If two labels apply, choose the one that describes the root cause rather than the symptom.",
    "Never infer a number that the text does not state; write 'not stated' instead.",
    "Treat a renamed flag or setting as a configuration issue, not as a bug in the software.",
    "Prefer the most specific component name that appears in the text.",
    "Mark the severity as high only when data is lost or a service is unavailable.",
    "Keep the summary under forty words and free of speculation.",
    "When the text reports a measurement, record its unit and the conditions it was taken under.",
]


def _shared_system_prompt(rng: random.Random, tokens: int) -> str:
    """Instructions plus a long rubric with background passages: the part every request shares."""
    parts = ["You are an analyst labelling incident reports for an engineering organisation. Read each report and "
             "return a JSON object with the fields component, label, severity, evidence and summary.", "Rubric:"]
    rule = 0
    while sum(len(p) + 1 for p in parts) < tokens * 4:
        parts.append(f"Rule {rule + 1}. {RUBRIC_RULES[rule % len(RUBRIC_RULES)]} Background: "
                     f"{_passage(rng, 360)}")
        rule += 1
    return "\n".join(parts)[: tokens * 4]


def _template(rng: random.Random, index: int, tokens: int) -> str:
    """Worked examples for one kind of report (the few-shot part several requests share)."""
    shots = [f"Template {index + 1}: worked examples follow."]
    shot = 0
    while sum(len(p) + 1 for p in shots) < tokens * 4:
        label = rng.choice(["configuration", "capacity", "regression", "hardware", "documentation"])
        shots.append(f"Example {shot + 1}. Report: {_passage(rng, 420)} Answer: {{\"label\": \"{label}\", "
                     f"\"severity\": \"{rng.choice(['low', 'medium', 'high'])}\"}}")
        shot += 1
    return "\n".join(shots)[: tokens * 4]


def make_shared_prefix_rows(n: int, seed: int = 0) -> list[dict]:
    """Chat rows: one shared system prompt, one of ``TEMPLATES`` few-shot templates, then a unique report."""
    rng = random.Random(seed)
    system = _shared_system_prompt(rng, SHARED_PREFIX_TOKENS)
    templates = [_template(rng, i, TEMPLATE_TOKENS) for i in range(TEMPLATES)]
    rows = []
    for i in range(n):
        report = _passage(rng, int(rng.triangular(100, 250, 150)) * 4)
        user = f"{templates[rng.randrange(TEMPLATES)]}\n\nNow label this report (item {i}).\nReport: {report}"
        rows.append({"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                     "max_tokens": rng.choice([256, 384, 512])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=None, help="default 400 (shared-prefix: 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared-prefix", action="store_true",
                        help="the shared-system-prompt sample (default out: prompts-shared-prefix.jsonl)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.shared_prefix:
        rows = make_shared_prefix_rows(args.rows or 100, args.seed)
        args.out = args.out or Path(__file__).with_name("prompts-shared-prefix.jsonl")
    else:
        rows = make_rows(args.rows or 400, args.seed)
        args.out = args.out or Path(__file__).with_name("prompts.jsonl")
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
