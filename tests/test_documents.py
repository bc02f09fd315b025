"""Tests for `longctx.documents`: the sample report and notes, text decoding, and every way a
document can be refused. PDFs are built on the fly with pypdf only (no fpdf2 in CI)."""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import io
import re
from pathlib import Path

import pytest
from pypdf import PageObject, PdfReader, PdfWriter
from pypdf.errors import DependencyError

from longctx.documents import Document, _normalize, read_document
from pdfs import text_pdf
from longctx.errors import DocumentError

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
REPORT = SAMPLES / "report.pdf"
NOTES = SAMPLES / "notes.md"

# (page, sentence as written, question, expected answer) -- kept in step with samples/README.md.
REPORT_FACTS = [
    (1, "The cooperative was founded in 1987 in the town of Port Ellery.", "In what year was the cooperative founded?", "1987"),
    (
        1,
        "The cooperative was founded in 1987 in the town of Port Ellery.",
        "In which town was the cooperative founded?",
        "Port Ellery",
    ),
    (1, "The cooperative has 3,412 members.", "How many members does the cooperative have?", "3,412"),
    (
        2,
        "The chief engineer of the cooperative is Marta Okonkwo.",
        "Who is the chief engineer of the cooperative?",
        "Marta Okonkwo",
    ),
    (2, "Every turbine in the fleet is a Selkie T-40.", "Which turbine model does the cooperative use?", "Selkie T-40"),
    (
        2,
        "The total installed capacity is 48 megawatts.",
        "What is the total installed capacity of the cooperative?",
        "48 megawatts",
    ),
    (2, "The largest tidal array is Gannet Reef.", "What is the largest tidal array of the cooperative?", "Gannet Reef"),
]
REPORT_TABLE_ROWS = [
    "Array Turbines Capacity (MW) Output (GWh) Availability (%)",
    "Gannet Reef 16 19.2 54.3 97.1",
    "Kestrel Sound 12 14.4 40.1 96.4",
    "Harrow Point 8 9.6 23.8 88.2",
    "Little Skerry 4 4.8 13.6 95.9",
    "Total 40 48.0 131.8 95.0",
    "Item 2024 2025 Change (%)",
    "Electricity sales to members 9,870 10,640 7.8",
    "Surplus returned to members 1,150 1,390 20.9",
]
NOTES_FACTS = [
    "The survey was led by Dr. Ines Halvorsen.",
    "The survey boat is called the Dunlin.",
    "The deepest point measured was 83 metres.",
]


def _pdf_bytes(writer: PdfWriter) -> bytes:
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def _text_pdf(pages: list[str]) -> bytes:
    """A PDF whose pages show the given text in Helvetica ("" gives a text-less page)."""
    return text_pdf(pages)


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def report() -> Document:
    return read_document(REPORT)


# --- the sample report ------------------------------------------------------------------------


def test_report_metadata(report: Document) -> None:
    assert report.kind == "pdf"
    assert report.name == "report.pdf"
    assert report.path == str(REPORT)
    assert report.pages == len(PdfReader(REPORT).pages) == 4
    assert report.empty_pages == ()
    assert report.encoding == ""
    assert report.sha256 == hashlib.sha256(REPORT.read_bytes()).hexdigest()


@pytest.mark.parametrize(("page", "sentence", "question", "answer"), REPORT_FACTS)
def test_report_contains_fact_on_its_page(report: Document, page: int, sentence: str, question: str, answer: str) -> None:
    assert sentence in report.text
    assert answer in sentence
    start = report.text.index(f"[Page {page}]\n")
    end = report.text.find(f"[Page {page + 1}]\n")
    assert sentence in report.text[start : end if end != -1 else None]


def test_report_page_markers(report: Document) -> None:
    markers = re.findall(r"^\[Page (\d+)\]$", report.text, flags=re.MULTILINE)
    assert markers == ["1", "2", "3", "4"]
    assert report.text.startswith("[Page 1]\nNorthwind Tidal Energy Cooperative\n")
    assert "\n\n[Page 2]\n3. Operations\n" in report.text


def test_report_table_rows_are_whole_lines(report: Document) -> None:
    lines = set(report.text.splitlines())
    for row in REPORT_TABLE_ROWS:
        assert row in lines


def test_report_whitespace_is_normalized(report: Document) -> None:
    assert "  " not in report.text
    assert "\n\n\n" not in report.text
    assert all(line == line.strip() for line in report.text.splitlines())
    assert report.text == report.text.strip()


def test_report_size_stays_small(report: Document) -> None:
    words = len(report.text.split())
    assert 800 <= words <= 1300, words  # CI prefills this on a slow CPU


def test_progress_called_per_page() -> None:
    calls: list[tuple[int, int]] = []
    read_document(str(REPORT), progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_read_is_deterministic_and_frozen(report: Document) -> None:
    assert read_document(str(REPORT)) == report
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.text = ""  # type: ignore[misc]


# --- PDFs built on the fly --------------------------------------------------------------------


def test_synthetic_pdf_spaces_collapsed(tmp_path: Path) -> None:
    path = _write(tmp_path, "t.pdf", _text_pdf(["Hello    world   \nsecond  line", "Page two."]))
    doc = read_document(path)
    assert doc.text == "[Page 1]\nHello world\nsecond line\n\n[Page 2]\nPage two."
    assert doc.pages == 2


def test_normalize_keeps_paragraphs_and_spells_out_ligatures() -> None:
    raw = "  The \ufb01rst\u00a0 e\ufb00ect  \r\n\r\n\r\n\n co\u00adoperative\t\tline \n"
    assert _normalize(raw) == "The first effect\n\ncooperative line"


def test_partly_empty_pdf_lists_empty_pages(tmp_path: Path) -> None:
    writer = PdfWriter(clone_from=REPORT)
    writer.insert_blank_page(index=1)
    doc = read_document(_write(tmp_path, "gap.pdf", _pdf_bytes(writer)))
    assert doc.pages == 5
    assert doc.empty_pages == (2,)
    assert "[Page 1]\n" in doc.text and "\n\n[Page 2]\n\n[Page 3]\n3. Operations" in doc.text
    assert "Marta Okonkwo" in doc.text


def test_image_only_pdf_needs_ocr(tmp_path: Path) -> None:
    writer = PdfWriter()
    for _ in range(3):
        writer.add_blank_page(612, 792)
    with pytest.raises(DocumentError, match="no extractable text") as err:
        read_document(_write(tmp_path, "scan.pdf", _pdf_bytes(writer)))
    assert "OCR" in str(err.value) and "ocrmypdf" in str(err.value)


def test_pdf_without_pages(tmp_path: Path) -> None:
    with pytest.raises(DocumentError, match="no pages"):
        read_document(_write(tmp_path, "none.pdf", _pdf_bytes(PdfWriter())))


def test_pdf_magic_with_other_extension_is_read_as_pdf(tmp_path: Path) -> None:
    doc = read_document(_write(tmp_path, "download.bin", REPORT.read_bytes()))
    assert doc.kind == "pdf" and doc.pages == 4


def test_text_file_that_mentions_pdf_magic_stays_text(tmp_path: Path) -> None:
    doc = read_document(_write(tmp_path, "notes.md", b"A PDF file starts with `%PDF-1.7`.\n"))
    assert doc.kind == "markdown" and "%PDF-1.7" in doc.text


def test_encrypted_pdf_needs_password(tmp_path: Path) -> None:
    writer = PdfWriter(clone_from=REPORT)
    writer.encrypt("s3cret", algorithm="RC4-128")  # RC4 works without `cryptography`
    path = _write(tmp_path, "locked.pdf", _pdf_bytes(writer))
    with pytest.raises(DocumentError, match="encrypted") as err:
        read_document(path)
    assert "--password" in str(err.value)
    with pytest.raises(DocumentError, match="[Ww]rong password"):
        read_document(path, password="guess")
    doc = read_document(path, password="s3cret")
    assert "Marta Okonkwo" in doc.text and doc.pages == 4


def test_pdf_with_empty_user_password_opens_without_one(tmp_path: Path) -> None:
    writer = PdfWriter(clone_from=REPORT)
    writer.encrypt("", owner_password="owner", algorithm="RC4-128")
    doc = read_document(_write(tmp_path, "restricted.pdf", _pdf_bytes(writer)))
    assert "Selkie T-40" in doc.text


def test_password_for_unencrypted_pdf_is_ignored() -> None:
    assert read_document(REPORT, password="unused").pages == 4


def test_missing_crypto_dependency_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = PdfWriter(clone_from=REPORT)
    writer.encrypt("s3cret", algorithm="RC4-128")
    path = _write(tmp_path, "aes.pdf", _pdf_bytes(writer))

    def needs_crypto(self: PdfReader, password: str) -> None:
        raise DependencyError("cryptography>=3.1 is required for AES algorithm")

    monkeypatch.setattr(PdfReader, "decrypt", needs_crypto)
    with pytest.raises(DocumentError, match="pip install cryptography"):
        read_document(path, password="s3cret")


@pytest.mark.parametrize("keep", [0.2, 0.5, 0.9])
def test_truncated_pdf(tmp_path: Path, keep: float) -> None:
    data = REPORT.read_bytes()
    path = _write(tmp_path, "cut.pdf", data[: int(len(data) * keep)])
    with pytest.raises(DocumentError, match="damaged or truncated"):
        read_document(path)


def test_garbage_after_pdf_header(tmp_path: Path) -> None:
    path = _write(tmp_path, "junk.pdf", b"%PDF-1.7\n" + bytes(range(256)) * 8)
    with pytest.raises(DocumentError, match="damaged or truncated"):
        read_document(path)


def test_named_pdf_but_not_a_pdf(tmp_path: Path) -> None:
    path = _write(tmp_path, "page.pdf", b"<html><body>404 Not Found</body></html>\n")
    with pytest.raises(DocumentError, match="not a PDF"):
        read_document(path)


def test_unreadable_page_is_listed_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, "t.pdf", _text_pdf(["first page", "BROKEN", "third page"]))
    original = PageObject.extract_text

    def flaky(self: PageObject, *args: object, **kwargs: object) -> str:
        text = original(self, *args, **kwargs)
        if "BROKEN" in text:
            raise KeyError("/Font")
        return text

    monkeypatch.setattr(PageObject, "extract_text", flaky)
    doc = read_document(path)
    assert doc.empty_pages == (2,) and "third page" in doc.text


def test_all_pages_unreadable_is_damaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, "t.pdf", _text_pdf(["one", "two"]))

    def broken(self: PageObject, *args: object, **kwargs: object) -> str:
        raise ValueError("bad content stream")

    monkeypatch.setattr(PageObject, "extract_text", broken)
    with pytest.raises(DocumentError, match="damaged or truncated.*bad content stream"):
        read_document(path)


# --- text and markdown ------------------------------------------------------------------------


def test_notes_markdown() -> None:
    doc = read_document(NOTES)
    assert doc.kind == "markdown" and doc.pages == 1 and doc.encoding == "utf-8"
    assert doc.sha256 == hashlib.sha256(NOTES.read_bytes()).hexdigest()
    assert doc.text == NOTES.read_text(encoding="utf-8")
    for sentence in NOTES_FACTS:
        assert sentence in doc.text
    assert doc.empty_pages == ()


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("a.txt", "text"),
        ("a.text", "text"),
        ("a.md", "markdown"),
        ("a.MARKDOWN", "markdown"),
        ("a.rst", "text"),
        ("README", "text"),
    ],
)
def test_text_kinds(tmp_path: Path, name: str, kind: str) -> None:
    calls: list[tuple[int, int]] = []
    doc = read_document(
        _write(tmp_path, name, "# Title\n\n  indented caf\u00e9\n".encode()),
        progress=lambda done, total: calls.append((done, total)),
    )
    assert (doc.kind, doc.text, doc.name, doc.pages) == (kind, "# Title\n\n  indented caf\u00e9\n", name, 1)
    assert calls == [(1, 1)]


def test_utf8_bom_stripped_and_crlf_normalized(tmp_path: Path) -> None:
    data = codecs.BOM_UTF8 + "line one\r\nline two\rline three\r\n".encode()
    doc = read_document(_write(tmp_path, "bom.txt", data))
    assert doc.text == "line one\nline two\nline three\n"
    assert doc.encoding == "utf-8"
    assert doc.sha256 == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("codec", ["utf-16", "utf-16-be", "utf-32"])
def test_utf16_and_utf32_with_bom(tmp_path: Path, codec: str) -> None:
    text = "Gr\u00fc\u00dfe aus K\u00f6ln\r\nzweite Zeile\n"
    data = text.encode(codec)
    if codec == "utf-16-be":
        data = codecs.BOM_UTF16_BE + data
    doc = read_document(_write(tmp_path, "wide.txt", data))
    assert doc.text == "Gr\u00fc\u00dfe aus K\u00f6ln\nzweite Zeile\n"
    assert doc.encoding == codec[:6]


def test_invalid_utf16_after_bom(tmp_path: Path) -> None:
    path = _write(tmp_path, "odd.txt", codecs.BOM_UTF16_LE + b"\x00\xd8a\x00")  # lone surrogate
    with pytest.raises(DocumentError, match="UTF-16"):
        read_document(path)


def test_latin1_text_is_refused_with_offset_and_iconv(tmp_path: Path) -> None:
    path = _write(tmp_path, "old.txt", "caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(DocumentError) as err:
        read_document(path)
    message = str(err.value)
    assert "not UTF-8" in message and "offset 3" in message and "0xe9" in message
    assert "iconv -f" in message and "-t utf-8" in message and "old.txt" in message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["data.txt", "data.md", "image.png"])
def test_binary_content_is_refused(tmp_path: Path, name: str) -> None:
    data = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x01\x00"
    with pytest.raises(DocumentError, match="binary"):
        read_document(_write(tmp_path, name, data))


# --- files that are not there or hold nothing -------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DocumentError, match="not found") as err:
        read_document(tmp_path / "nope.pdf")
    assert "nope.pdf" in str(err.value)


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(DocumentError, match="directory"):
        read_document(tmp_path)


@pytest.mark.parametrize(
    ("name", "data", "word"),
    [
        ("empty.txt", b"", "empty"),
        ("empty.pdf", b"", "empty"),
        ("blank.md", b" \n\t\r\n  ", "blank"),
        ("blank16.txt", " \n \n".encode("utf-16"), "blank"),
    ],
)
def test_empty_files(tmp_path: Path, name: str, data: bytes, word: str) -> None:
    with pytest.raises(DocumentError, match=word) as err:
        read_document(_write(tmp_path, name, data))
    assert "nothing to ingest" in str(err.value)


def test_every_error_is_one_line(tmp_path: Path) -> None:
    cases = [
        tmp_path / "missing.txt",
        tmp_path,
        _write(tmp_path, "e.txt", b""),
        _write(tmp_path, "h.pdf", b"<html>"),
        _write(tmp_path, "cut.pdf", REPORT.read_bytes()[:3000]),
        _write(tmp_path, "l.txt", b"\xff\xfe"[1:] + b"abc"),
    ]
    for path in cases:
        with pytest.raises(DocumentError) as err:
            read_document(path)
        assert str(err.value) and "\n" not in str(err.value), path
