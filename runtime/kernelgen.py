"""Backend-neutral helpers of kernel code generation, shared by runtime/cpu and runtime/cuda."""
from __future__ import annotations


def batch_index(name, out_batch, batch, tmp=("j", "r")) -> list:
    """Source lines binding `name`, the flat batch index into an operand of batch shape `batch`
    (right-aligned, broadcast over size-1 axes) for the flat output batch index `b` of batch
    shape `out_batch`; `tmp` names the two scratch variables the lines use."""
    if tuple(batch) == tuple(out_batch):
        return [f"{name} = b"]
    j, r = tmp
    lines, stride, lead = [f"{name} = 0", f"{r} = b"], 1, len(out_batch) - len(batch)
    for ax in reversed(range(len(out_batch))):
        d = out_batch[ax]
        lines += [f"{j} = {r} % {d}", f"{r} = {r} // {d}"]
        bax = ax - lead
        if bax >= 0 and batch[bax] != 1:
            lines.append(f"{name} += {j} * {stride}")
        if bax >= 0:
            stride *= batch[bax]
    return lines


def feeding(g, nid, members) -> set:
    """The members of a kernel that node `nid` reads, directly or through other members."""
    mem, out, todo = set(members), set(), [nid]
    while todo:
        for i in g.nodes[todo.pop()].inputs:
            if i in mem and i not in out:
                out.add(i)
                todo.append(i)
    return out
