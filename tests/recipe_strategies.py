"""Hypothesis strategies for hostile recipes (used by test_recipe_fuzz.py).

Three layers, each able to reach deeper than the one before:
  pipeline_text -- the pipeline language, generated from the grammar's shapes
                   (tiers, chains, K/V splits, calls, refs, nested calls) with odd values;
  recipe_doc    -- a recipe as YAML data, every field sometimes of the wrong type;
  recipe_bytes  -- that document rendered, then mutated as text and bytes (tags,
                   anchors/aliases, nesting, huge scalars, control characters,
                   duplicated lines, truncation, bit flips) and encoded (UTF-8/16/32,
                   BOMs, Latin-1), sometimes padded past the file limit.
"""

import yaml
from hypothesis import strategies as st

from veloxquant.recipe.limits import MAX_FILE_BYTES
from veloxquant.stages import REGISTRY

STAGES = sorted(REGISTRY)
STAGE_PARAMS = {name: [f.name for f in info.params] for name, info in REGISTRY.items()}
PARAM_NAMES = ["bits", "group", "window", "budget", "sinks", "n", "x", "score", "recent"]
WORDS = [
    "channel",
    "token",
    "gaussian",
    "laplace",
    "mass",
    "current",
    "proxy",
    "tensor",
    "true",
    "false",
    "keys",
    "values",
    "linear",
    "pyramid",
]
NUMBERS = [
    "0",
    "1",
    "2",
    "3",
    "4",
    "8",
    "9",
    "16",
    "32",
    "64",
    "128",
    "256",
    "-1",
    "-0",
    "-0.0",
    "0.5",
    "1.5",
    "1e309",
    "-1e309",
    "1e-400",
    "2e0",
    "16777216",
    "16777217",
    "4294967296",
    "9" * 40,
    "9" * 5000,
    "9" * 400,
    "9" * 400 + ".5",
]
YAML_ODD = [
    "~",
    "null",
    "true",
    "no",
    "0x1F",
    "0o17",
    ".inf",
    "-.inf",
    ".nan",
    "1e309",
    "-0",
    "1_000",
    "2001-12-14",
    "12:30:00",
    "'x'",
    '"\\x00"',
    "[]",
    "{}",
    "[1, 2]",
    "{a: 1}",
    "&a [*a]",
    "*undefined",
    "!!binary AAA",
    "!!python/object/apply:os.system [x]",
    "!!timestamp x",
    "!!set {a}",
    "!foo bar",
    "|",
    ">-",
    "? a",
    "- - -",
    "9" * 5000,
    "linear(from=1, to=2)",
    "pyramid(from=1e309, to=1)",
    "linear(1)",
    "linear(from=a, to=b)",
]
SELECTORS = [
    "0",
    "1",
    "-1",
    "0-3",
    "0..29",
    "3-1",
    "29",
    "30",
    "-31",
    "sliding",
    "full",
    "all",
    "0,2,4",
    "0,0",
    "0-999999999",
    "99999999999999999999",
    "a",
    "",
    "0-",
    "1e3",
    " 0 ",
    "9" * 5000,
    "0-" + "9" * 30,
]
SCHEDULES = [
    "linear(from=1024, to=128)",
    "pyramid(from=448, to=64)",
    "linear(from=1e309, to=1)",
    "pyramid(from=-5, to=9999999999)",
    "linear(to=3)",
    "linear(from=1, to=2, x=3)",
    "linear(",
    "pyramid()",
]
EXTENDS = [
    "parent.yaml",
    "self.yaml",
    "cycle_a.yaml",
    "chain_00.yaml",
    "utf16_parent.yaml",
    "missing.yaml",
    "kivi",
    "h2o",
    "no_such_builtin",
    "/dev/null",
    "sub/",
    "",
    "a" * 5000,
    "a\0b",
    "a/" * 3000,
    "~",
]
TAGS = [
    "!!binary ",
    "!!python/object/apply:os.system ['x'] #",
    "!!timestamp ",
    "!!set ",
    "!!map ",
    "!!seq ",
    "!!int ",
    "!!float ",
    "!!str ",
    "!!null ",
    "!local ",
    "!!omap ",
    "!<tag:evil> ",
]
ENCODINGS = ["utf-8"] * 6 + ["utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "latin-1"]

odd_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from([10**30, -(10**30), float("inf"), float("nan"), -0.0]),
)
odd_value = st.recursive(
    odd_scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)


@st.composite
def arg_value(draw, depth=0):
    kind = draw(st.integers(0, 9))
    if kind <= 3:
        return draw(st.sampled_from(NUMBERS))
    if kind == 4:
        return draw(st.sampled_from(WORDS))
    if kind == 5:
        return "$" + draw(st.sampled_from(PARAM_NAMES + ["unknown"]))
    if kind == 6:
        return '"' + draw(st.text(alphabet=st.characters(blacklist_characters='"\\'), max_size=8)) + '"'
    if kind == 7 and depth < 3:
        return draw(call_text(depth + 1))
    return draw(st.sampled_from(["", "(", ")", "=", "$", "1.", ".5", "--1", "keys", "a b"]))


@st.composite
def call_text(draw, depth=0):
    name = draw(st.sampled_from(STAGES + ["nope", "Recent", "keys", "values"]))
    if draw(st.booleans()):
        return name
    args = []
    for _ in range(draw(st.integers(0, 3))):
        value = draw(arg_value(depth))
        if draw(st.booleans()):
            key = draw(st.sampled_from(STAGE_PARAMS.get(name, []) + ["bits", "zzz"]))
            args.append(f"{key}={value}")
        else:
            args.append(value)
    return f"{name}({', '.join(args)}{',' if draw(st.booleans()) and args else ''})"


@st.composite
def pipeline_text(draw):
    kind = draw(st.integers(0, 19))
    if kind == 0:  # deep nesting, sometimes unbalanced
        n = draw(st.integers(1, 3000))
        return "residual(" * n + draw(st.sampled_from(["fp16", "lloydmax(bits=2)", ""])) + ")" * draw(st.integers(0, n))
    if kind == 1:  # long
        return " >> ".join([draw(call_text())] * draw(st.integers(1, 600)))
    tiers = []
    for _ in range(draw(st.integers(1, 4))):
        chain = [draw(call_text()) for _ in range(draw(st.integers(1, 3)))]
        if draw(st.integers(0, 4)) == 0:
            side = lambda: " | ".join(draw(call_text()) for _ in range(draw(st.integers(1, 2))))  # noqa: E731
            chain.append(f"keys: {side()} values: {side()}")
        tiers.append(" | ".join(chain))
    text = draw(st.sampled_from([" >> ", "\n>> ", ">>"])).join(tiers)
    for _ in range(draw(st.integers(0, 2))):  # a stray character of the language
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(list('()|>,=$:"#\n\t ;{}[]') + ["keys:", "values:", ">>"])) + text[at:]
    return text


param_spec = st.one_of(
    st.sampled_from(NUMBERS[:12]).map(yaml.safe_load),
    st.sampled_from(SCHEDULES),
    st.sampled_from(WORDS),
    st.sampled_from([{"default": 1.5, "type": "float"}, {"default": 10**400, "type": "float"}, {"default": 10**400}]),
    st.lists(st.sampled_from([1, 2, 128, 1.5, 10**20, float("nan"), "x"]), min_size=0, max_size=31),
    st.fixed_dictionaries(
        {},
        optional={
            "default": odd_scalar | st.sampled_from(SCHEDULES),
            "type": st.sampled_from(["int", "float", "bool", "str", "list", 3]) | odd_value,
            "doc": st.text(max_size=10),
            "extra": st.just(1),
        },
    ),
    odd_value,
)

layer_body = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "pipeline": pipeline_text() | odd_value,
            "params": st.dictionaries(st.sampled_from(PARAM_NAMES), param_spec, max_size=3) | odd_value,
            "other": odd_value,
        },
    ),
    odd_value,
)


@st.composite
def recipe_doc(draw):
    def field(good, odds=8):  # mostly well-typed, so that checks deeper in are reached too
        return draw(odd_value) if draw(st.integers(0, odds)) == 0 else draw(good)

    doc = {}
    if draw(st.integers(0, 10)):
        doc["veloxquant"] = field(st.just(1))
    if draw(st.integers(0, 10)):
        doc["name"] = field(st.text(min_size=1, max_size=12))
    if draw(st.integers(0, 3)) == 0:
        doc["extends"] = field(st.sampled_from(EXTENDS))
    if draw(st.booleans()):
        doc["params"] = field(st.dictionaries(st.sampled_from(PARAM_NAMES + ["1bad", "a-b"]), param_spec, max_size=4))
    if draw(st.integers(0, 8)):
        doc["pipeline"] = field(pipeline_text())
    if draw(st.integers(0, 2)) == 0:
        selectors = st.sampled_from(SELECTORS) | st.integers(-40, 40)
        doc["layers"] = field(st.dictionaries(selectors, layer_body, max_size=3))
    if draw(st.integers(0, 6)) == 0:
        doc[draw(st.sampled_from(["summary", "paper", "unknown", "Pipeline"]))] = draw(odd_value)
    return doc


def render(doc) -> str:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=200)


@st.composite
def mutated_text(draw, text):
    lines = text.splitlines() or [""]
    for _ in range(draw(st.integers(0, 3))):
        lines = lines or [""]  # a deleted last line
        kind, i = draw(st.integers(0, 12)), draw(st.integers(0, len(lines) - 1))
        line = lines[i]
        if kind == 0 and ": " in line:  # a tag on a value
            at = line.index(": ") + 2
            lines[i] = line[:at] + draw(st.sampled_from(TAGS)) + line[at:]
        elif kind == 1:  # anchors and aliases: self reference, a bomb, undefined, reuse
            lines += draw(
                st.sampled_from(
                    [
                        ["x: &p {b: *p}"],
                        ["params: &p {bits: *p}"],
                        ["x: &a [*a]"],
                        ["x: *nope"],
                        ["lol:", "  a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
                        + [f"  {c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")],
                        ["base: &b {bits: 2}", "params: {<<: *b}"],
                        ["p: &q fp16", "pipeline: *q"],
                    ]
                )
            )
        elif kind == 2:  # nesting
            n = draw(st.integers(1, 400))
            lines.insert(i, "deep: " + "[" * n + "1" + "]" * draw(st.sampled_from([n, 0, n - 1])))
        elif kind == 3:  # a huge scalar
            lines.insert(i, f"summary: {'a' * draw(st.sampled_from([10**3, 10**5, MAX_FILE_BYTES - 200]))}")
        elif kind == 4:  # a special number where a digit is
            digits = [j for j, c in enumerate(line) if c.isdigit()]
            if digits:
                j = draw(st.sampled_from(digits))
                lines[i] = line[:j] + draw(st.sampled_from(NUMBERS + YAML_ODD)) + line[j + 1 :]
        elif kind == 5:  # a character YAML refuses, or one it allows but that is odd
            j = draw(st.integers(0, len(line)))
            ch = draw(
                st.sampled_from(
                    [
                        "\x00",
                        "\x01",
                        "\x07",
                        "\x1b",
                        "\x7f",
                        "\x85",
                        "\u2028",
                        "\ufeff",
                        "\ufffe",
                        "\t",
                        "\r",
                        "\u00e9",
                        "\U0001f600",
                        "\\",
                    ]
                )
            )
            lines[i] = line[:j] + ch + line[j:]
        elif kind == 6:
            lines.insert(i, line)  # a duplicated line: duplicate keys
        elif kind == 7:
            del lines[i]
        elif kind == 8:  # an odd value for a known field
            key = draw(st.sampled_from(["veloxquant", "name", "extends", "params", "pipeline", "layers"]))
            lines.append(f"{key}: {draw(st.sampled_from(YAML_ODD))}")
        elif kind == 9:
            lines[i] = line.replace("  ", "\t", 1)
        elif kind == 10:
            lines.insert(i, draw(st.sampled_from(["---", "...", "%YAML 1.1", "%TAG ! tag:x,2000:", "--- |", "#", ""])))
        elif kind == 11:  # set a known-parameter to an odd thing
            lines.append(f"params: {{{draw(st.sampled_from(PARAM_NAMES))}: {draw(st.sampled_from(YAML_ODD))}}}")
        else:
            lines[i] = line[: draw(st.integers(0, len(line)))]  # truncated line
    return "\n".join(lines) + draw(st.sampled_from(["\n", "", "\r\n"]))


@st.composite
def recipe_bytes(draw):
    base = draw(st.one_of(recipe_doc().map(render), st.sampled_from(BUILTIN_TEXTS)))
    text = draw(mutated_text(base)) if draw(st.integers(0, 3)) else base
    data = text.encode(draw(st.sampled_from(ENCODINGS)), errors="replace")
    if draw(st.integers(0, 3)) == 0:  # bytes: truncation, bit flips
        for _ in range(draw(st.integers(1, 3))):
            if not data:
                break
            j = draw(st.integers(0, len(data) - 1))
            if draw(st.booleans()):
                data = data[:j]
            else:
                data = data[:j] + bytes([data[j] ^ (1 << draw(st.integers(0, 7)))]) + data[j + 1 :]
    if draw(st.integers(0, 60)) == 0:  # near and past the file limit
        pad = MAX_FILE_BYTES - len(data) + draw(st.sampled_from([-100, 10, 3 * MAX_FILE_BYTES]))
        data += b"#" + b"x" * pad + b"\n"
    return data


set_value = st.tuples(
    st.sampled_from(PARAM_NAMES + ["", "bits ", "a=b"]), st.sampled_from(NUMBERS + YAML_ODD + SCHEDULES)
).map(lambda kv: f"{kv[0]}={kv[1]}") | st.sampled_from(["bits", "=", "==", "bits=", "bits=\x00"])


def _builtin_texts():
    from veloxquant.paths import recipes_dir

    return [p.read_text() for p in sorted(recipes_dir().glob("*.yaml"))]


BUILTIN_TEXTS = _builtin_texts()
