"""Word documents for the knowledge tests, written by python-docx: an ordinary one, and one whose
document part inflates to any size (a zip bomb of a few megabytes)."""

from __future__ import annotations

import io
import zipfile

import docx

MB = 1024 * 1024


def make_docx() -> bytes:
    document = docx.Document()
    document.add_heading("Keeper handbook", level=1)
    document.add_paragraph("The lamp is lit at dusk.")
    table = document.add_table(rows=3, cols=3)
    for col, name in enumerate(["Part", "Material", "Note"]):
        table.cell(0, col).text = name
    table.cell(1, 0).text = "lens"
    table.cell(1, 1).merge(table.cell(1, 2)).text = "glass, merged across two columns"
    table.cell(2, 0).text = "lamp"
    inner = table.cell(2, 1).add_table(rows=1, cols=2)
    inner.cell(0, 0).text = "brass"
    inner.cell(0, 1).text = "polished"
    document.add_paragraph("")  # an empty paragraph gives no block
    document.add_paragraph("After the table: café, 灯塔.")
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def docx_bomb(expanded: int, paragraph: bytes = b"lamp " * 200) -> bytes:
    """A .docx whose document part inflates to ``expanded`` bytes of paragraphs (a few MB zipped)."""
    template = zipfile.ZipFile(io.BytesIO(make_docx()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for info in template.infolist():
            if info.filename != "word/document.xml":
                z.writestr(info, template.read(info))
        block = b"<w:p><w:r><w:t>" + paragraph + b"</w:t></w:r></w:p>"
        block *= MB // len(block)
        with z.open("word/document.xml", "w", force_zip64=True) as part:
            part.write(
                b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?><w:document xmlns:w='
                b'"http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body>'
            )
            for _ in range(expanded // len(block)):
                part.write(block)
            part.write(b"</w:body></w:document>")
    return out.getvalue()
