"""What a pass did, in numbers and in lines a person can read."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Report:
    name: str
    stats: dict = field(default_factory=dict)
    lines: list = field(default_factory=list)

    def __str__(self) -> str:
        head = f"# pass {self.name}: " + ", ".join(f"{k}={v}" for k, v in self.stats.items())
        return "\n".join([head] + [f"#   {line}" for line in self.lines])
