"""native_build: a missing compiler is the only reason the native kernel tests skip; a compiler
that fails is a failure, with its message, and a failed build is never cached."""

import pytest

from radixlang.kernels import native_build

BROKEN = 'extern "C" int radixlang_probe() { return radixlang_undeclared_name; }\n'
FIXED = 'extern "C" int radixlang_probe() { return 7; }\n'


@pytest.fixture
def probe_source(tmp_path, monkeypatch):
    """A source directory holding ``probe.cpp`` (broken) and a cache of its own, in tmp_path."""
    source_dir = tmp_path / "src"
    source_dir.mkdir()
    (source_dir / "probe.cpp").write_text(BROKEN)
    monkeypatch.setattr(native_build, "SOURCE_DIR", source_dir)
    monkeypatch.setenv("RADIXLANG_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RADIXLANG_NATIVE", raising=False)
    return source_dir / "probe.cpp"


def needs_compiler() -> None:
    try:
        native_build.find_compiler()
    except native_build.NativeBuildError as exc:
        pytest.skip(str(exc))


def test_a_compile_error_fails_with_the_compilers_message_and_is_not_cached(probe_source, tmp_path):
    needs_compiler()
    for _ in range(2):  # the second try builds again: nothing of the first was kept
        with pytest.raises(native_build.NativeBuildError) as info:
            native_build.skip_reason(lambda: native_build.load("probe"))
        message = str(info.value)
        assert "building probe.cpp failed" in message
        assert "radixlang_undeclared_name" in message  # the compiler's own words
        assert "error" in message
        cache = tmp_path / "cache" / "native"
        assert not list(cache.glob("*.so")) and not list(cache.glob("*.tmp*"))

    probe_source.write_text(FIXED)  # a new source, a new name: it builds and loads
    assert native_build.skip_reason(lambda: native_build.load("probe")) is None
    assert native_build.load("probe").radixlang_probe() == 7
    assert len(list((tmp_path / "cache" / "native").glob("probe-*.so"))) == 1


def test_at_run_time_a_compile_error_warns_with_the_message_and_falls_back(probe_source):
    needs_compiler()
    with pytest.warns(UserWarning, match="radixlang_undeclared_name") as record:
        assert native_build.usable(lambda: native_build.load("probe"), "probe kernel") is False
    # Only the build's warning: the garbage collector can emit others inside the block (an
    # earlier test's unclosed event loop, a ResourceWarning), so record[0] may be another's.
    ours = [str(w.message) for w in record if "radixlang_undeclared_name" in str(w.message)]
    assert len(ours) == 1 and "probe kernel unavailable, using torch" in ours[0]


def test_no_compiler_found_is_a_reason_to_skip(probe_source, tmp_path, monkeypatch):
    tried = []
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no g++, c++ or clang++ on it
    reason = native_build.skip_reason(lambda: tried.append("load"))
    assert reason is not None and "no C++ compiler found" in reason
    monkeypatch.setenv("CXX", "radixlang-no-such-compiler")
    reason = native_build.skip_reason(lambda: tried.append("load"))
    assert reason is not None and "radixlang-no-such-compiler" in reason
    assert tried == []  # nothing was built: a skip, not a failure


def test_the_native_kernels_turned_off_is_a_reason_to_skip(monkeypatch):
    monkeypatch.setenv("RADIXLANG_NATIVE", "0")
    assert native_build.skip_reason(lambda: pytest.fail("not tried")) == "RADIXLANG_NATIVE=0"
    assert native_build.usable(lambda: pytest.fail("not tried"), "probe kernel") is False
