"""The fuzz build's copy of kernels_cpp/: every GCC pragma the sources use is translated for clang.

`make fuzz` runs only after the suite in CI, so a new pragma in kernels_cpp/ would
otherwise first fail there, after the whole suite."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("clang_sources", ROOT / "fuzz" / "clang_sources.py")
clang_sources = importlib.util.module_from_spec(spec)
spec.loader.exec_module(clang_sources)


@pytest.mark.parametrize("path", sorted((ROOT / "kernels_cpp").glob("*.[ch]*")), ids=lambda p: p.name)
def test_every_kernel_source_translates(path):
    text = path.read_text()
    out = clang_sources.translate(text, path.name)
    assert out.count("\n") == text.count("\n")          # line numbers stay kernels_cpp/'s own
    assert "pragma GCC" not in out.replace("// (fuzz build) #pragma GCC push_options", "")


def test_translation_line_for_line():
    src = ('#pragma GCC push_options\n#pragma GCC target("avx2")\n'
           '    #pragma GCC unroll 32\nint f();\n#pragma GCC pop_options\n')
    assert clang_sources.translate(src, "x.cpp").splitlines() == [
        "// (fuzz build) #pragma GCC push_options",
        '#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)',
        "    #pragma unroll 32",
        "int f();",
        "#pragma clang attribute pop",
    ]


@pytest.mark.parametrize("src", ['#pragma GCC optimize("O3")\n', "#pragma GCC pop_options\n",
                                 '#pragma GCC push_options\n#pragma GCC target("avx2")\n',
                                 '#pragma GCC target("avx2")\n#pragma GCC target("avx512f")\n'
                                 '#pragma GCC pop_options\n#pragma GCC pop_options\n'])
def test_an_untranslated_or_unbalanced_pragma_stops_the_build(src):
    with pytest.raises(SystemExit):
        clang_sources.translate(src, "x.cpp")
