"""Task families for the tiny block-diffusion models. Every family but `shuffle` has exactly one right answer;
`shuffle` has many (any ordering of the given letters), so decoding several of its positions in one forward from
their separate marginals can produce a wrong answer (a letter twice): the family that makes the threshold of an
acceptance rule matter (the decoding trade-off the tiny models are for). `correct()` is the one judge of an answer.
Held-out instances are chosen by a property of the input (the sum of its character codes is a multiple
of 7), so they never occur in training data."""
import random

NAMES = ["Ada", "Alan", "Grace", "Linus", "Ken", "Dennis", "Barbara", "Edsger", "Donald", "Margaret", "John",
         "Frances", "Tim", "Guido", "Bjarne", "Anders", "Radia", "Leslie", "Niklaus", "Robin", "Shafi", "Judea",
         "Yann", "Fei", "Andrew", "Ilya", "Sam", "Mira", "Jeff", "Sanjay", "Hal", "Ivan", "Carl", "Emma", "Noah",
         "Olga", "Pavel", "Quinn", "Rosa", "Tara", "Uma", "Vera", "Walt", "Xena", "Yuki", "Zoe"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def sort_task(r):
    xs = [r.randint(0, 9) for _ in range(r.randint(3, 7))]
    return "sort " + " ".join(map(str, xs)), " ".join(map(str, sorted(xs)))


def reverse_task(r):
    xs = [r.choice(LETTERS) for _ in range(r.randint(3, 7))]
    return "reverse " + " ".join(xs), " ".join(reversed(xs))


def operand(r):
    """0-999 with a uniformly drawn digit count (1, 2 or 3): v1/v2 drew 0-999 uniformly, so 99% of their pairs had a
    3-digit operand and v2 could not add two small numbers."""
    d = r.randint(1, 3)
    return r.randint(0 if d == 1 else 10 ** (d - 1), 10 ** d - 1)


def add_task(r):
    a, b = operand(r), operand(r)
    return f"add {a}+{b}", str(a + b)


def repeat_task(r):
    w = "".join(r.choice(LETTERS) for _ in range(r.randint(2, 4)))
    n = r.randint(2, 4)
    return f"repeat {w} {n}", " ".join([w] * n)


def count_task(r):
    c = r.choice("abcde")
    s = "".join(r.choice("abcde") for _ in range(r.randint(5, 10)))
    return f"count {c} in {s}", str(s.count(c))


def made_up_name(r):
    return r.choice(LETTERS).upper() + "".join(r.choice(LETTERS) for _ in range(r.randint(1, 6)))


def hello_task(r):
    # half the names are made up, so the name has to be copied from the prompt (v2 saw only NAMES and could not
    # greet the three held-out ones)
    n = r.choice(NAMES) if r.random() < 0.5 else made_up_name(r)
    return f"hello {n}", f"Hello, {n}! Nice to meet you."


def shuffle_task(r):
    xs = r.sample(LETTERS, r.randint(3, 6))
    ys = r.sample(xs, len(xs))
    return "shuffle " + " ".join(xs), " ".join(ys)


TASKS = {"sort": sort_task, "reverse": reverse_task, "add": add_task, "repeat": repeat_task, "count": count_task,
         "hello": hello_task, "shuffle": shuffle_task}
V1_TASKS = ("sort", "reverse", "add", "repeat", "count", "hello")   # the families v1, v2 and the twins learned
MANY_ANSWERS = ("shuffle",)   # families whose instances have more than one right answer


def correct(task: str, prompt: str, answer: str, text: str) -> bool:
    """Whether a completion solves an instance: an exact match of the one answer, or for `shuffle` the given letters
    in any order (space-separated, each once)."""
    if task in MANY_ANSWERS:
        return sorted(text.split(" ")) == sorted(prompt.split(" ")[1:])
    return text == answer


def is_held_out(prompt: str) -> bool:
    return sum(map(ord, prompt)) % 7 == 0


def sample(r: random.Random, held_out: bool, task=None):
    """One (task, prompt, answer) from the training (held_out=False) or held-out split."""
    while True:
        name = task or r.choice(list(TASKS))
        p, a = TASKS[name](r)
        if is_held_out(p) == held_out:
            return name, p, a


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def render(prompt: str) -> str:
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def held_out(task, n, seed=7):
    """n held-out (prompt, answer) instances of one task family, seeded, repeats allowed (the trained models' tests)."""
    r = random.Random(seed)
    return [sample(r, True, task)[1:] for _ in range(n)]


def held_out_set(per_task, seed=1234):
    """Up to `per_task` distinct held-out (task, prompt, answer) instances per task family, seeded (the same list
    for training checks and benches/decoding/eval_tiny.py)."""
    r = random.Random(seed)
    seen, out = set(), []
    for task in TASKS:
        n = tries = 0
        while n < per_task and tries < 50 * per_task:  # some families have few distinct held-out inputs
            tries += 1
            _, p, a = sample(r, held_out=True, task=task)
            if p in seen:
                continue
            seen.add(p)
            out.append((task, p, a))
            n += 1
    return out
