"""Read a document (PDF, plain text or markdown) into a `Document`: its text plus what the rest of
longctx needs to key, cache and cite it.

PDF text comes from pypdf's plain extraction (content-stream order, which keeps multi-column
pages readable and table rows on one line each). Every page starts with a `[Page N]` line so
answers can cite pages. Every way a file can be unusable (missing, empty, not UTF-8, damaged,
encrypted, scanned) is raised as one `DocumentError` whose message says what to do about it.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from longctx.errors import DocumentError

MARKDOWN_SUFFIXES = (".md", ".markdown")
TEXT_SUFFIXES = (".txt", ".text", *MARKDOWN_SUFFIXES)
ProgressFn = Callable[[int, int], None]

# Horizontal whitespace pypdf emits between and around words (incl. no-break space).
_SPACES = re.compile(r"[ \t\f\v\u00a0\u2000-\u200a\u202f\u205f\u3000]+")
_BLANK_RUNS = re.compile(r"\n{3,}")
# Typographic ligatures (common in LaTeX output) and soft hyphens, which break word matching.
_LIGATURES = str.maketrans(
    {
        "\ufb00": "ff",
        "\ufb01": "fi",
        "\ufb02": "fl",
        "\ufb03": "ffi",
        "\ufb04": "ffl",
        "\ufb05": "st",
        "\ufb06": "st",
        "\u00ad": None,
    }
)
_BOMS = (  # (BOM, codec, name); UTF-32 first: its little-endian BOM starts with UTF-16's.
    (codecs.BOM_UTF32_LE, "utf-32-le", "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32-be", "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16-le", "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16-be", "utf-16"),
)


@dataclass(frozen=True)
class Document:
    """A document's extracted text and identity.

    Attributes:
        path: The path as given by the caller.
        name: The file name (last path component).
        kind: "pdf", "text" or "markdown".
        text: The extracted text; for PDFs each page starts with a `[Page N]` line.
        pages: Number of PDF pages (1 for text files).
        sha256: Hex SHA-256 of the file's bytes.
        empty_pages: 1-based PDF pages with no extractable text (callers should warn).
        encoding: The text file's encoding ("utf-8", "utf-16", "utf-32"); "" for PDFs.
    """

    path: str
    name: str
    kind: str
    text: str
    pages: int
    sha256: str
    empty_pages: tuple[int, ...] = ()
    encoding: str = ""


def read_document(path: str | Path, password: str | None = None, progress: ProgressFn | None = None) -> Document:
    """Read a PDF, text or markdown file.

    A file is a PDF if it is named `.pdf`, or has no text suffix (.txt, .text, .md, .markdown)
    and starts with the PDF magic `%PDF-`; anything else is read as text (`.md`/`.markdown`
    give kind "markdown") and must not be binary.

    Args:
        path: The file to read.
        password: Password of an encrypted PDF; ignored for unencrypted files.
        progress: Called as `progress(done, total)` after each page (once for text files).

    Returns:
        The `Document`.

    Raises:
        DocumentError: The file is missing, a directory, empty, binary, not UTF-8, not a valid
            PDF, encrypted without the right password, or has no extractable text.
    """
    file = Path(path)
    if not file.exists():
        raise DocumentError(f"File not found: {path}. Check the path and try again.")
    if file.is_dir():
        raise DocumentError(f"{path} is a directory; give the path of a PDF, text or markdown file.")
    try:
        data = file.read_bytes()
    except OSError as err:
        raise DocumentError(f"Cannot read {path}: {err.strerror or err}.") from err
    if not data.strip():
        what = "empty (0 bytes)" if not data else "blank (only whitespace)"
        raise DocumentError(f"{path} is {what}; there is nothing to ingest.")

    suffix = file.suffix.lower()
    is_pdf_name = suffix == ".pdf"
    has_magic = b"%PDF-" in data[:1024]  # the spec lets a header follow up to 1 KiB of junk
    if is_pdf_name and not has_magic:
        raise DocumentError(
            f"{path} is named .pdf but is not a PDF (no %PDF- header); it may "
            "be another format renamed, or an HTML error page saved by a "
            "download."
        )
    common = {"path": str(path), "name": file.name, "sha256": hashlib.sha256(data).hexdigest()}
    if is_pdf_name or (has_magic and suffix not in TEXT_SUFFIXES):
        text, pages, empty = _read_pdf(data, str(path), password, progress)
        return Document(kind="pdf", text=text, pages=pages, empty_pages=empty, **common)

    text, encoding = _decode_text(data, str(path))
    if not text.strip():
        raise DocumentError(f"{path} is blank (only whitespace); there is nothing to ingest.")
    if progress is not None:
        progress(1, 1)
    kind = "markdown" if suffix in MARKDOWN_SUFFIXES else "text"
    return Document(kind=kind, text=text, pages=1, encoding=encoding, **common)


def _decode_text(data: bytes, label: str) -> tuple[str, str]:
    """Decode a text file's bytes: UTF-8 (BOM stripped), or UTF-16/32 when a BOM says so.

    Args:
        data: The file's bytes (not empty).
        label: The path, for messages.

    Returns:
        (text with LF line endings, encoding name).
    """
    for bom, codec, encoding in _BOMS:
        if data.startswith(bom):
            try:
                text = data[len(bom) :].decode(codec)
            except UnicodeDecodeError as err:
                raise DocumentError(
                    f"{label} starts with a {encoding.upper()} byte-order mark "
                    f"but is not valid {encoding.upper()} (bad data at byte "
                    f"{err.start + len(bom)}); re-save it as UTF-8."
                ) from err
            return _check_binary(_unify_newlines(text), label), encoding
    if b"\x00" in data:
        raise DocumentError(
            f"{label} looks binary (it contains NUL bytes), not text; longctx "
            "reads PDF, plain text and markdown files (convert UTF-16 without a "
            "BOM to UTF-8 first)."
        )
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        name = Path(label).name
        raise DocumentError(
            f"{label} is not UTF-8 (first bad byte 0x{data[err.start]:02x} at "
            f"byte offset {err.start}); convert it first, e.g. `iconv -f cp1252 "
            f"-t utf-8 {name} > utf8-{name}` (use the file's real encoding in "
            "place of cp1252)."
        ) from err
    return _check_binary(_unify_newlines(text), label), "utf-8"


def _unify_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _check_binary(text: str, label: str) -> str:
    if "\x00" in text:
        raise DocumentError(f"{label} looks binary (it decodes to NUL characters), not text.")
    return text


def _read_pdf(data: bytes, label: str, password: str | None, progress: ProgressFn | None) -> tuple[str, int, tuple[int, ...]]:
    """Extract a PDF's text page by page.

    Args:
        data: The file's bytes.
        label: The path, for messages.
        password: Password for an encrypted file, or None.
        progress: Per-page `progress(done, total)` callback, or None.

    Returns:
        (text with `[Page N]` markers, page count, 1-based pages without text).
    """
    from pypdf import PasswordType, PdfReader  # here, not at the top: `ask` never reads PDFs
    from pypdf.errors import DependencyError

    # pypdf signals damage with many exception types (PdfReadError, KeyError, ValueError,
    # zlib.error, RecursionError...); for untrusted input any of them means "damaged file".
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            if password is None and reader.decrypt("") == PasswordType.NOT_DECRYPTED:
                raise DocumentError(f"{label} is encrypted; give its password with --password.")
            if password is not None and reader.decrypt(password) == PasswordType.NOT_DECRYPTED:
                raise DocumentError(f"Wrong password for {label}; check it and try again.")
        total = len(reader.pages)
    except DocumentError:
        raise
    except DependencyError as err:
        raise DocumentError(
            f"{label} needs an extra package to decrypt ({err}); install it with `pip install cryptography`."
        ) from err
    except Exception as err:
        raise DocumentError(_damaged(label, err)) from err
    if total == 0:
        raise DocumentError(f"{label} is a PDF with no pages; there is nothing to ingest.")

    chunks, empty, failures = [], [], []
    for number in range(1, total + 1):
        try:
            page_text = _normalize(reader.pages[number - 1].extract_text())
        except Exception as err:  # one bad page should not sink the others
            failures.append(err)
            page_text = ""
        if not page_text:
            empty.append(number)
        chunks.append(f"[Page {number}]\n{page_text}".rstrip())
        if progress is not None:
            progress(number, total)
    if len(empty) == total:
        if failures:
            raise DocumentError(_damaged(label, failures[0]))
        raise DocumentError(
            f"{label} has no extractable text (it looks scanned or image-only); "
            "run OCR first, e.g. `ocrmypdf in.pdf out.pdf`, and ingest the "
            "result."
        )
    return "\n\n".join(chunks), total, tuple(empty)


def _damaged(label: str, err: Exception) -> str:
    detail = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
    return (
        f"{label} is a damaged or truncated PDF that cannot be read ({detail}); re-download it or re-save it from a PDF viewer."
    )


def _normalize(text: str) -> str:
    """Tidy one page of extracted text: one space between words, no trailing spaces, at most one
    blank line in a row, ligatures spelled out; line and paragraph breaks are kept.

    Args:
        text: Text as pypdf extracted it.

    Returns:
        The normalized text, without leading or trailing blank lines.
    """
    text = _unify_newlines(text.translate(_LIGATURES)).replace("\x00", "")
    lines = (_SPACES.sub(" ", line).strip() for line in text.split("\n"))
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines)).strip()
