"""tests/data: every file there is listed in its README's checksum table with its size and md5,
so a corrupted, re-encoded (end-of-line conversion) or unlisted fixture fails here by name rather
than as a wrong perplexity or token id elsewhere. A folder with a README of its own (arch/,
vocab/: made by scripts, with their provenance there) names each of its files in it."""
import hashlib
import re

ROW = re.compile(r"^\| `([^`]+)` \| ([\d,]+) \| ([0-9a-f]{32}) \|$", re.M)
NOT_DATA = {"README.md", ".gitattributes"}


def test_every_file_matches_the_readme_checksums(testdata):
    root = testdata.stories.parent
    listed = {name: (int(size.replace(",", "")), md5)
              for name, size, md5 in ROW.findall((root / "README.md").read_text())}
    assert len(listed) == 7
    own = {p.parent for p in root.glob("*/README.md")}          # folders documented apart
    files = [p for p in root.rglob("*") if p.is_file() and p.name not in NOT_DATA
             and "__pycache__" not in p.parts]
    present = {p.relative_to(root).as_posix() for p in files if p.parent not in own}
    assert present == set(listed), (sorted(present - set(listed)), sorted(set(listed) - present))
    for name, (size, md5) in listed.items():
        data = (root / name).read_bytes()
        assert (len(data), hashlib.md5(data).hexdigest()) == (size, md5), name


def test_folders_with_their_own_readme_name_every_file(testdata):
    root = testdata.stories.parent
    folders = [p.parent for p in root.glob("*/README.md")]
    assert {f.name for f in folders} >= {"arch", "vocab"}
    for folder in folders:
        text = (folder / "README.md").read_text()
        for p in folder.iterdir():
            if p.is_file() and p.name not in NOT_DATA:
                stem = re.sub(r"(\.gguf.*|-logits\.npy|-reference\.json|\.py|\.json)$", "",
                              p.name)
                assert stem in text, f"{folder.name}/{p.name} is not named in its README"
