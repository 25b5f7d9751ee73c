"""CSV that a spreadsheet opens as data, never as formulas (OWASP's CSV injection rule).

A text cell that begins with = + - @, a tab or a carriage return (a run or variant name, an error
message quoting an engine) is prefixed with a single quote, so Excel or LibreOffice shows it instead of
running `=cmd|...`. Numbers stay numbers: a negative overhead is a number, not a formula.
"""
import csv
import io

_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def cell(value):
    """`value`, with a leading quote when it is text a spreadsheet would read as a formula."""
    if isinstance(value, str) and value.startswith(_FORMULA_STARTS):
        return "'" + value
    return value


def rows_text(header: list, rows) -> str:
    """The CSV text of `header` and `rows`, every cell through `cell`."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([cell(v) for v in header])
    writer.writerows([cell(v) for v in row] for row in rows)
    return out.getvalue()
