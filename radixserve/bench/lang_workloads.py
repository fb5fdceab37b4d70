"""The programs of `radixserve bench programs`, written with `radixserve.lang` as a user would
write them, and the generated data they run on (the shapes of the SGLang paper's
workloads; no downloads).

Text is made from a small word list with a seeded `random.Random`, so two runs send the same
programs. Each builder returns a `Workload`: one program and the argument sets `run_batch`
runs it on. Lengths are in words (about 1.3 SmolLM2 tokens each).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import radixserve.lang as sgl

WORDS = """
river mountain garden window lantern kettle bridge harbor meadow valley forest engine
signal market village castle orchard island desert canyon glacier compass anchor ladder
mirror pencil basket blanket candle feather hammer jacket marble needle pillow ribbon
saddle ticket tunnel violin wagon whistle farmer baker sailor doctor teacher painter
miner pilot tailor weaver student merchant quiet bright heavy gentle rapid narrow ancient
golden silver hollow frozen steady sudden distant humble curious careful hungry patient
carries builds finds opens follows measures gathers repairs watches crosses lifts paints
counts sells plants guards fills shapes before after during beneath across between near
under over inside around toward every each many several small large early late old new
""".split()
LETTERS = "ABCD"
SUBJECTS = ("astronomy", "geography", "chemistry", "economics", "biology", "history")
DIMENSIONS = ("accuracy", "clarity", "structure", "style", "depth", "concision")
JSON_FIELDS = (  # (field, regex, max_tokens): a record is decoded field by field
    ("name", r"[A-Z][a-z]{1,10}( [A-Z][a-z]{1,10})?", 8),
    ("age", r"[1-9][0-9]?", 3),
    ("city", r"[A-Z][a-z]{1,12}", 6),
    ("job", r"[a-z]{2,12}", 5),
    ("height_cm", r"1[4-9][0-9]", 3),
)


@dataclass(frozen=True)
class Workload:
    name: str
    program: Any  # a radixserve.lang function
    batch: list[dict[str, Any]]  # one argument set per program


# -- generated text ---------------------------------------------------------------------------
def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def sentence(rng: random.Random, n: int) -> str:
    text = words(rng, n)
    return text[0].upper() + text[1:] + "."


def paragraph(rng: random.Random, n_words: int, per_sentence: int = 12) -> str:
    return " ".join(sentence(rng, per_sentence) for _ in range(max(1, n_words // per_sentence)))


def mmlu_question(rng: random.Random, question_words: int, option_words: int) -> str:
    options = "".join(f"{letter}. {words(rng, option_words)}\n" for letter in LETTERS)
    return f"{sentence(rng, question_words)[:-1]}?\n{options}Answer:"


def mmlu_example(rng: random.Random, question_words: int, option_words: int) -> str:
    return f"{mmlu_question(rng, question_words, option_words)} {rng.choice(LETTERS)}\n\n"


# -- 1. few-shot multiple choice (MMLU-shaped) ------------------------------------------------
@sgl.function
def few_shot_mmlu(s, examples, question):
    s += examples + question
    s += sgl.gen("answer", max_tokens=1)


def mmlu_workload(rng: random.Random, n: int, shots: int = 5) -> Workload:
    """`n` questions, 8 per subject; the programs of a subject share its 5-shot prompt."""
    subjects = SUBJECTS[: max(1, min(len(SUBJECTS), n // 8))]
    examples = {
        subject: f"The following are multiple choice questions (with answers) about {subject}."
        "\n\n" + "".join(mmlu_example(rng, 36, 8) for _ in range(shots))
        for subject in subjects
    }
    batch = [
        {"examples": examples[subjects[i % len(subjects)]], "question": mmlu_question(rng, 18, 5)}
        for i in range(n)
    ]
    return Workload("mmlu (5-shot)", few_shot_mmlu, batch)


# -- 2. select among endings (HellaSwag-shaped) -----------------------------------------------
@sgl.function
def hellaswag(s, few_shot, context, endings):
    s += few_shot + context
    s += sgl.select("ending", choices=endings)


def hellaswag_workload(rng: random.Random, n: int, shots: int = 3) -> Workload:
    """One few-shot context shared by every program (bound, so tracing finds it), then the
    program's own context and 4 candidate endings."""
    few_shot = "".join(f"{sentence(rng, 24)} {sentence(rng, 10)}\n\n" for _ in range(shots))
    batch = [
        {"context": sentence(rng, 16), "endings": [" " + sentence(rng, 8) for _ in range(4)]}
        for _ in range(n)
    ]
    return Workload("hellaswag (select)", hellaswag.bind(few_shot=few_shot), batch)


# -- 3. tree of thought: fork 2, each fork 2, then a final answer ------------------------------
TOT_SYSTEM = (
    "You are a careful planner. For each problem you propose plans, carry each plan out in "
    "short steps, and then compare the results to pick the best answer. "
)


@sgl.function
def tree_of_thought(s, background, question):
    s += sgl.system(TOT_SYSTEM + background)
    s += sgl.user(question)
    plans = s.fork(2)
    plans += lambda i: sgl.assistant(f"Plan {i + 1}:" + sgl.gen("plan", max_tokens=12))
    branches = []
    for plan in plans:  # each plan's fork waits for that plan alone: the others keep going
        plan += sgl.user("Carry out this plan, one short step.")
        steps = plan.fork(2)
        steps += sgl.assistant(sgl.gen("step", max_tokens=12))
        branches.append(steps)
    for steps in branches:
        steps.join()
    plans.join()
    candidates = "\n".join(f"- {step}" for branch in s["step"] for step in branch)
    s += sgl.user(f"The candidate steps were:\n{candidates}\nWhich one is best?")
    s += sgl.assistant(sgl.gen("final", max_tokens=12))


def tot_workload(rng: random.Random, n: int) -> Workload:
    batch = [
        {"background": paragraph(rng, 132), "question": sentence(rng, 18)[:-1] + "?"}
        for _ in range(n)
    ]
    return Workload("tree of thought", tree_of_thought, batch)


# -- 4. skeleton of thought: a skeleton, 5 expansions in parallel, a summary ----------------
SOT_SYSTEM = (
    "You are a helpful assistant who answers in a skeleton of short points first, then "
    "expands each point into one sentence. "
)


@sgl.function
def skeleton_of_thought(s, topic, question, num_points=5):
    s += sgl.system(SOT_SYSTEM + topic)
    s += sgl.user(f"Give a skeleton of {num_points} short points answering: {question}")
    s += sgl.assistant(sgl.gen("skeleton", max_tokens=16))
    points = s.fork(num_points)
    points += lambda i: sgl.user(f"Expand point {i + 1} in one sentence.")
    points += sgl.assistant(sgl.gen("point", max_tokens=10))
    points.join()
    expanded = "\n".join(f"{i + 1}. {p}" for i, p in enumerate(s["point"]))
    s += sgl.user(f"The expanded points:\n{expanded}\nSum them up in one sentence.")
    s += sgl.assistant(sgl.gen("summary", max_tokens=12))


def sot_workload(rng: random.Random, n: int) -> Workload:
    batch = [
        {"topic": paragraph(rng, 168), "question": sentence(rng, 14)[:-1] + "?"} for _ in range(n)
    ]
    return Workload("skeleton of thought", skeleton_of_thought, batch)


# -- 5. LLM judge: 6 dimensions in parallel, then a verdict -----------------------------------
@sgl.function
def llm_judge(s, article):
    s += sgl.system("You are a strict reviewer of short articles.")
    s += sgl.user(f"Here is an article:\n\n{article}")
    s += sgl.assistant("I have read the article.")
    judges = s.fork(len(DIMENSIONS))
    judges += lambda i: sgl.user(f"Judge its {DIMENSIONS[i]} in one sentence.")
    judges += sgl.assistant(sgl.gen("judgment", max_tokens=12))
    judges.join()
    notes = "\n".join(f"{d}: {j}" for d, j in zip(DIMENSIONS, s["judgment"]))
    s += sgl.user(f"Your notes:\n{notes}\nGive the article a score from 1 to 10.")
    s += sgl.assistant(sgl.gen("verdict", max_tokens=6))


def judge_workload(rng: random.Random, n: int) -> Workload:
    return Workload("llm judge", llm_judge, [{"article": paragraph(rng, 204)} for _ in range(n)])


# -- 6. JSON decoding with a regex per field ---------------------------------------------------
JSON_INSTRUCTIONS = (
    "Each line below describes a person. Write the person's record as JSON with the fields "
    + ", ".join(f for f, _, _ in JSON_FIELDS)
    + ". Names and cities are capitalized words, the job is one lowercase word.\n\n"
)


@sgl.function
def json_record(s, instructions, description):
    s += instructions + "Description: " + description + "\nRecord:\n"
    with s.var_scope("record"):
        s += "{\n"
        for i, (field, regex, max_tokens) in enumerate(JSON_FIELDS):
            quote = '"' if field in ("name", "city", "job") else ""
            s += f'  "{field}": ' + quote
            s += sgl.gen(field, max_tokens=max_tokens, regex=regex)
            s += quote + (",\n" if i < len(JSON_FIELDS) - 1 else "\n")
        s += "}"


def json_workload(rng: random.Random, n: int) -> Workload:
    """Shared instructions with one example record (bound), then each program's description."""
    example = (
        "Description: A quiet baker from a village near the river, forty years old.\n"
        'Record:\n{\n  "name": "Anna Berg",\n  "age": 40,\n  "city": "Lund",\n'
        '  "job": "baker",\n  "height_cm": 168\n}\n\n'
    )
    instructions = JSON_INSTRUCTIONS + paragraph(rng, 36) + "\n\n" + example
    batch = [{"description": sentence(rng, 20)} for _ in range(n)]
    return Workload("json (regex)", json_record.bind(instructions=instructions), batch)


# -- 7. multi-turn chat ------------------------------------------------------------------------
@sgl.function
def multi_turn_chat(s, system, questions):
    s += sgl.system(system)
    for i, question in enumerate(questions):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=10))


def chat_workload(rng: random.Random, n: int, turns: int = 4) -> Workload:
    """Conversations of `turns` short questions; groups of 4 share a system prompt."""
    systems = [paragraph(rng, 72) for _ in range(max(1, n // 4))]
    batch = [
        {
            "system": systems[i % len(systems)],
            "questions": [sentence(rng, 14)[:-1] + "?" for _ in range(turns)],
        }
        for i in range(n)
    ]
    return Workload("multi-turn chat", multi_turn_chat, batch)


BUILDERS = {
    "mmlu": mmlu_workload,
    "hellaswag": hellaswag_workload,
    "tot": tot_workload,
    "sot": sot_workload,
    "judge": judge_workload,
    "json": json_workload,
    "chat": chat_workload,
}


def build_workloads(sizes: dict[str, int], seed: int) -> list[Workload]:
    """The workloads named in `sizes` (keys of BUILDERS), `sizes[name]` programs each, in
    that order; each from its own seeded generator, so its data do not depend on which
    others run."""
    return [
        BUILDERS[name](random.Random(f"{seed}:{name}"), n) for name, n in sizes.items() if n > 0
    ]
