"""The CPU backend's spelling of elementwise ops (the expression each computes inside the loops
of runtime/cpu/fused.py, rules.py ELEMENTWISE) and of row ops (their formula, OpDef.rows, as the
line templates of fused.rows), calling runtime/cpu/approx.py where the portable expressions
call libm."""
from __future__ import annotations

from jitgraph.registry import get_op


def approx(name, dtype) -> str:
    """The function of runtime/cpu/approx.py computing `name` in `dtype`, as generated code
    (which imports that module) calls it: approx.f<name> for f32, approx.d<name> otherwise.
    Generated code names the function of its dtype rather than approx's generic v<name>:
    numba inlines a generic overload used twice in one function with an SSA warning."""
    return f"approx.{'f' if dtype == 'f32' else 'd'}{name}"


def _approx(name, arity=1):
    args = ", ".join(f"{{{i}}}" for i in range(arity))
    return {dt: f"{approx(name, dt)}({args})" for dt in ("f32", "f64")}


# The CPU spelling of the elementwise ops whose portable expression calls libm, per dtype: the
# branch-free functions of runtime/cpu/approx.py (within 3 ulp in f32, 2 ulp in f64). One libm
# call (math.exp, math.log1p, ...) in a loop keeps LLVM from vectorising the whole loop, so in
# a fused kernel it made every member scalar (and the fused kernel slower than the unfused
# ones; bench/README.md: "Figures behind the code", approx). Still libm:
# float64 pow and round_f16 (frexp, ldexp); a fused kernel holding one of them runs scalar.
EXPR = {**{op: _approx(op) for op in ("exp", "log", "tanh", "sigmoid", "softplus", "silu",
                                      "gelu")},
        **{op: _approx(op, 2) for op in ("silu_back", "gelu_back")},
        "pow": {"f32": "approx.fpow({0}, {p})"}}


# a half value in a kernel is its bits (uint16); runtime/cpu/halfconv.py converts
_FROM_HALF = {"f16": "halfconv.f16_f32({0})", "bf16": "halfconv.bf16_f32({0})"}
_TO_HALF = {"f16": "halfconv.f32_f16(np.float32({0}))", "bf16": "halfconv.f32_bf16(np.float32({0}))"}


def expr(op, dtype, sources=()) -> str:
    """Op's scalar expression template in `dtype` over operands of dtypes `sources` as this
    backend spells it: EXPR's where it has one, else the op's portable OpDef.expr. The only
    op computing with half types is the conversion (OpDef.half "convert": passes/half.py
    rewrites the others), spelled through f32."""
    d = get_op(op)
    if dtype in _TO_HALF or any(s in _FROM_HALF for s in sources):
        if d.half != "convert":
            raise NotImplementedError(f"{op} over {', '.join(sources)} -> {dtype}: the CPU "
                                      f"backend computes half types only by conversion "
                                      f"(passes/half.py)")
        src = _FROM_HALF.get(sources[0], "{0}")
        return _TO_HALF[dtype].format(src) if dtype in _TO_HALF else src
    return EXPR.get(op, {}).get(dtype) or d.expr


# Per-element math of row formulas, as fused.rows spells it: {exp} is approx's exp of the
# row's dtype. The lines run once per row (a pass's `after`) keep libm.
ROW_FUNCS = {"math.exp(": "{exp}("}
# how a row accumulator takes an element's term: the maximum by fmaximum (a select that
# vectorises, where max() is a compare and branch: runtime/cpu/minmax.py)
_INIT = {"sum": "{0} = 0.0", "max": "{0} = {{T}}(-math.inf)"}
_TAKE = {"sum": "{0} += {1}", "max": "{0} = fmaximum({0}, {1})"}


def _element(expr: str) -> str:
    for portable, own in ROW_FUNCS.items():
        expr = expr.replace(portable, own)
    return expr.replace("{out}", "{buf}[r, j]")


def row_templates(formula):
    """(passes, final) of a RowFormula as runtime/cpu/rules.py Rows holds them: per pass
    (setup, per element, after) lines; a pass's `store` writes its let into the output row
    ({buf})."""
    passes = []
    for p in formula.passes:
        per = [f"{name} = {_element(e)}" for name, e in p.lets]
        if p.store:
            per.append(f"{{buf}}[r, j] = {p.store}")
        per += [_TAKE[comb].format(name, _element(term)) for name, comb, term in p.accs]
        passes.append(([_INIT[comb].format(name) for name, comb, _ in p.accs], per,
                       list(p.after)))
    return tuple(passes), _element(formula.final)


def uses_max(formula) -> bool:
    """Whether the formula's kernel calls fmaximum (its module imports it)."""
    return any(comb == "max" for p in formula.passes for _, comb, _ in p.accs)
