"""Pipeline text -> syntax tree, with errors placed in the recipe file."""

from functools import lru_cache
from typing import Callable, Tuple

import lark

from ..errors import Location, RecipeError
from ..paths import grammar_file
from .ast import Arg, Call, Num, Pipeline, Ref, Str, Tier, Word
from .limits import MAX_CALL_NESTING, MAX_PIPELINE_STAGES

# Maps a (line, column) inside the pipeline text to a place in the recipe file.
Locate = Callable[[int, int], Location]

_TOKEN_WORDS = {
    "NAME": "a stage name",
    "SIGNED_NUMBER": "a number",
    "ESCAPED_STRING": "a string",
    "LPAR": "'('",
    "RPAR": "')'",
    "COMMA": "','",
    "EQUAL": "'='",
    "VBAR": "'|'",
    "__ANON_0": "'>>'",
    "DOLLAR": "'$'",
    "COLON": "':'",
    "SIDE": "'keys:' or 'values:'",
    "$END": "end of pipeline",
}


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark(grammar_file().read_text(), parser="lalr", start=["pipeline", "value"], propagate_positions=True)


def _linecol(meta_or_token) -> Tuple[int, int]:
    return getattr(meta_or_token, "line", 1) or 1, getattr(meta_or_token, "column", 1) or 1


class _ToAst(lark.Transformer):
    """Builds the AST; each node's `pos` is its place in the recipe file."""

    def __init__(self, locate: Locate):
        super().__init__()
        self._locate = locate

    def _pos(self, meta_or_token) -> Location:
        return self._locate(*_linecol(meta_or_token))

    def number(self, items):
        tok = items[0]
        text = str(tok)
        try:
            value = float(text) if any(c in text for c in ".eE") else int(text)
        except ValueError as e:  # an int of more digits than Python converts
            raise RecipeError(
                f"number {_short(text)} cannot be read ({str(e).split(';')[0]})", self._pos(tok)
            ) from None
        return Num(value, self._pos(tok))

    def string(self, items):
        tok = items[0]
        return Str(str(tok)[1:-1].replace('\\"', '"'), self._pos(tok))

    def ref(self, items):
        return Ref(str(items[0]), self._pos(items[0]))

    def word(self, items):
        return Word(str(items[0]), self._pos(items[0]))

    def call(self, items):
        return Call(str(items[0]), tuple(items[1] or ()), self._pos(items[0]))

    stage = call

    def args(self, items):
        return tuple(a for a in items if a is not None)

    def kwarg(self, items):
        return Arg(str(items[0]), items[1], self._pos(items[0]))

    def posarg(self, items):
        return Arg(None, items[0], items[0].pos)

    def chain(self, items):
        return tuple(items)

    def side(self, items):
        return (str(items[0]), items[1])

    def split(self, items):
        sides = dict(items)
        if len(items) != 2 or len(sides) != 2:
            raise ValueError("split")
        return sides

    @lark.v_args(meta=True)
    def tier(self, meta, items):
        split = items[-1] if isinstance(items[-1], dict) else None
        stages = tuple(items[:-1] if split else items)
        if split:
            return Tier(stages, split["keys"], split["values"], self._pos(meta))
        return Tier(stages, pos=self._pos(meta))

    def pipeline(self, items):
        return Pipeline(tuple(items))


def _expected(expected) -> str:
    words = sorted({_TOKEN_WORDS.get(e, repr(e)) for e in expected})
    return ", ".join(words[:6])


def _parse(text: str, start: str, locate: Locate, what: str):
    if not text.strip():
        raise RecipeError(f"{what} is empty", locate(1, 1), "write at least one stage, e.g. 'fp16'")
    try:
        tree = _parser().parse(text, start=start)
    except lark.UnexpectedCharacters as e:
        raise RecipeError(
            f"unexpected character {text[e.pos_in_stream]!r} in {what}",
            locate(e.line, e.column),
            f"expected {_expected(e.allowed)}",
        ) from None
    except lark.UnexpectedToken as e:
        line, col = (e.line, e.column) if e.line and e.line > 0 else _end(text)
        problem = f"{what} ends too early" if e.token.type == "$END" else f"unexpected {str(e.token)!r} in {what}"
        raise RecipeError(problem, locate(line, col), f"expected {_expected(e.expected)}") from None
    except lark.UnexpectedEOF as e:
        raise RecipeError(f"{what} ends too early", locate(*_end(text)), f"expected {_expected(e.expected)}") from None
    _check_size(tree, locate, what)
    try:
        return _ToAst(locate).transform(tree)
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, RecipeError):
            raise e.orig_exc from None
        if str(e.orig_exc) == "split":
            meta = getattr(e.obj, "meta", None)
            raise RecipeError(
                "a split needs one 'keys:' chain and one 'values:' chain",
                locate(*_linecol(meta)),
                "write 'keys: affine(...) values: affine(...)', or drop the split to give "
                "keys and values the same chain",
            ) from None
        raise


def _check_size(tree: lark.Tree, locate: Locate, what: str) -> None:
    """Refuse calls nested or repeated past the limits before the (recursive) transformer
    sees them: residual(residual(... 500 deep ...)) would overflow Python's stack."""
    calls, stack = 0, [(tree, 0)]
    while stack:  # iterative: the tree may be arbitrarily deep
        node, depth = stack.pop()
        if not isinstance(node, lark.Tree):
            continue
        if node.data in ("stage", "call"):
            calls, depth = calls + 1, depth + 1
            if depth > MAX_CALL_NESTING:
                raise RecipeError(
                    f"stage calls nest more than {MAX_CALL_NESTING} deep in {what}",
                    locate(*_linecol(node.meta)),
                    "a stage argument holds a value or one stage, e.g. residual(lloydmax(bits=2))",
                )
            if calls > MAX_PIPELINE_STAGES:
                raise RecipeError(
                    f"{what} has more than {MAX_PIPELINE_STAGES} stage calls",
                    locate(*_linecol(node.meta)),
                    "a pipeline is a few tiers of a few stages each",
                )
        stack.extend((child, depth) for child in node.children)


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _end(text: str) -> Tuple[int, int]:
    lines = text.rstrip().splitlines() or [""]
    return len(lines), len(lines[-1]) + 1


def parse_pipeline(text: str, locate: Locate) -> Pipeline:
    return _parse(text, "pipeline", locate, "pipeline")


def parse_value(text: str, locate: Locate):
    """A parameter value written in the pipeline language, e.g. a schedule."""
    return _parse(text, "value", locate, "value")
