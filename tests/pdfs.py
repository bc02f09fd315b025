"""Build small text PDFs in tests with pypdf alone (fpdf2 is a dev-only dependency)."""

from __future__ import annotations

import io

from pypdf import PdfWriter
from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject


def text_pdf(pages: list[str], password: str | None = None) -> bytes:
    """A PDF whose pages show the given text in Helvetica, one line per "\\n" ("" gives a page
    without text); encrypted with RC4-128 (no `cryptography` needed) when `password` is given."""
    writer = PdfWriter()
    font = DictionaryObject(
        {
            NameObject("/Type"): NameObject("/Font"),
            NameObject("/Subtype"): NameObject("/Type1"),
            NameObject("/BaseFont"): NameObject("/Helvetica"),
        }
    )
    for text in pages:
        page = writer.add_blank_page(612, 792)
        if not text:
            continue
        ops = [b"BT /F1 12 Tf 14 TL 72 720 Td"]
        for line in text.split("\n"):
            escaped = line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
            ops.append(b"(" + escaped.encode("latin-1") + b") Tj T*")
        ops.append(b"ET")
        stream = DecodedStreamObject()
        stream.set_data(b"\n".join(ops))
        page[NameObject("/Resources")] = DictionaryObject({NameObject("/Font"): DictionaryObject({NameObject("/F1"): font})})
        page.replace_contents(stream)
    if password:
        writer.encrypt(password, algorithm="RC4-128")
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()
