"""scripts/check-structure.py measures every function body in src/: functions at namespace scope, member
functions defined in a class body, operator() bodies and lambdas, but not classes, namespaces, data
tables or control blocks. Each case is a synthetic source with a known length."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_structure", ROOT / "scripts" / "check-structure.py")
check_structure = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_structure)
LIMIT = check_structure.MAX_FUNCTION_LINES


def body(lines):
    return "".join(f"    x += {i};\n" for i in range(lines))


def lengths(tmp_path, source):
    path = tmp_path / "case.cpp"
    path.write_text(source)
    return check_structure.long_functions(path)


# Each source's function spans first line .. closing brace: signature (1) + statements + closing brace (1).
LONG = LIMIT - 2  # statements making a function of LIMIT + 1 lines, with its return and closing brace


@pytest.mark.parametrize("source, first", [
    (f"int f(int x) {{\n{body(LONG)}  return x;\n}}\n", 1),
    (f"template <class T>\nT f(T x) {{\n{body(LONG)}  return x;\n}}\n", 2),
    (f"namespace n {{\nstruct Kernel {{\n  int operator()(int x) const {{\n{body(LONG)}  return x;\n  }}\n}};\n}}\n", 3),
    (f"class C {{\n public:\n  void run(int x,\n           int y) noexcept(true) {{\n{body(LONG)}  }}\n}};\n", 3),
    (f"const auto f = [](int x) {{\n{body(LONG)}  return x;\n}};\n", 1),
    (f"auto f = [&] {{\n{body(LONG)}  return x;\n}};\n", 1),
    (f"auto h() -> int {{\n{body(LONG)}  return 0;\n}}\n", 1),
    (f"Pool::Pool(int n) : n_(n), v_(std::vector<int>(n)) {{\n{body(LONG)}  n_ = 1;\n}}\n", 1),
])
def test_a_function_over_the_limit_is_found_wherever_it_is_defined(tmp_path, source, first):
    found = lengths(tmp_path, source)
    assert found and found[0] == (first, LIMIT + 1), found


def test_a_lambda_is_measured_and_counts_in_its_function(tmp_path):
    source = f"int g(int x) {{\n  auto f = [&](int y) {{\n{body(LONG)}    return y;\n  }};\n  return f(x);\n}}\n"
    assert lengths(tmp_path, source) == [(1, LIMIT + 4), (2, LIMIT + 1)]


def test_a_function_at_the_limit_passes(tmp_path):
    assert lengths(tmp_path, f"int f(int x) {{\n{body(LONG - 1)}  return x;\n}}\n") == []
    assert lengths(tmp_path, f"struct S {{\n  void f() {{\n{body(LONG)}  }}\n}};\n") == []


def test_classes_namespaces_tables_and_control_blocks_are_not_functions(tmp_path):
    short_methods = "".join(f"  int m{i}() const {{ return {i}; }}\n" for i in range(3 * LIMIT))
    table = "const int kTable[] = {\n" + "".join(f"    {i},\n" for i in range(3 * LIMIT)) + "};\n"
    source = f"namespace n {{\nclass Big {{\n{short_methods}}};\n{table}}}\n"
    assert lengths(tmp_path, source) == []
    # a long if/for/while block is not a function of its own (its function, short here, is not long)
    assert lengths(tmp_path, "int f(int x) {\n  if (x) {\n    x = 1;\n  }\n  return x;\n}\n") == []


def test_braces_in_comments_and_strings_do_not_count(tmp_path):
    noise = '    s = "}}}"; c = \'}\'; // }}}\n    /* } */ t = R"(})";\n'
    source = f"int f(int x) {{\n{noise * (LONG // 2)}  return x;\n}}\n"
    assert lengths(tmp_path, source) == [(1, 2 * (LONG // 2) + 3)]


def test_the_library_is_within_the_limits():
    assert check_structure.main() == 0
