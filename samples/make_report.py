"""Generate `samples/report.pdf`, the sample document used by tests and demos.

The report is fictional ("Annual Report of the Northwind Tidal Energy Cooperative, 2025"): four
pages of headings, paragraphs and two tables, with a handful of distinctive facts stated once in
short plain sentences so that even a tiny model can answer questions about them by copying from
context. `samples/README.md` lists those facts and the questions tests ask.

The text is kept to about 900 words (under 1,500 tokens) because CI prefills it on a slow CPU.
Only this script needs `fpdf2` (`pip install fpdf2`, a dev-only dependency); the PDF is committed.
It uses the core Helvetica font, so every character must be latin-1. Output is deterministic: the
creation date is fixed, so regenerating gives the same text (and, with the same fpdf2 version,
the same bytes).

Usage: `python samples/make_report.py [OUTPUT]` (default: `report.pdf` next to this script).
"""

from __future__ import annotations

import sys
from datetime import datetime, timezone
from pathlib import Path

from fpdf import FPDF
from pypdf import PdfReader

TITLE = "Annual Report of the Northwind Tidal Energy Cooperative, 2025"
FIXED_DATE = datetime(2026, 3, 2, 9, 0, 0, tzinfo=timezone.utc)

# The facts tests ask about: (sentence as written in the report, question, expected answer).
# `build` checks that each sentence survives text extraction on a single line.
FACTS: list[tuple[str, str, str]] = [
    ("The cooperative was founded in 1987 in the town of Port Ellery.",
     "In what year was the cooperative founded?", "1987"),
    ("The cooperative was founded in 1987 in the town of Port Ellery.",
     "In which town was the cooperative founded?", "Port Ellery"),
    ("The cooperative has 3,412 members.",
     "How many members does the cooperative have?", "3,412"),
    ("The chief engineer of the cooperative is Marta Okonkwo.",
     "Who is the chief engineer of the cooperative?", "Marta Okonkwo"),
    ("Every turbine in the fleet is a Selkie T-40.",
     "Which turbine model does the cooperative use?", "Selkie T-40"),
    ("The total installed capacity is 48 megawatts.",
     "What is the total installed capacity of the cooperative?", "48 megawatts"),
    ("The largest tidal array is Gannet Reef.",
     "What is the largest tidal array of the cooperative?", "Gannet Reef"),
]

# Each page is a list of blocks: ("h", heading), ("p", paragraph) or ("t", table rows).
# The first row of a table is its header.
PAGES: list[list[tuple[str, object]]] = [
    [
        ("h", "1. About the Cooperative"),
        ("p", "The Northwind Tidal Energy Cooperative generates electricity from the tides "
              "along the northern coast and sells it to its members at cost."),
        ("p", "The cooperative was founded in 1987 in the town of Port Ellery. "
              "It began as a group of fishing families who wanted a local source of power that "
              "did not depend on imported fuel, and its office is still in the old harbour "
              "master's house."),
        ("p", "The cooperative has 3,412 members. "
              "Each member holds one vote at the annual general meeting, whatever the size of "
              "their share, and any household in the district may join."),
        ("p", "Tidal power is predictable. The tides follow the moon, so output can be "
              "forecast years ahead, unlike wind or sunlight. This lets the cooperative sign "
              "long supply contracts with the regional grid and keep prices stable for "
              "households and small businesses."),
        ("h", "2. Letter from the Board"),
        ("p", "The year 2025 was the strongest in our history. Generation rose by nine percent "
              "over 2024, the new maintenance barge entered service in April, and no worker "
              "was injured during more than 41,000 hours of offshore work. The board thanks "
              "every member, diver, technician and volunteer who made this possible."),
        ("p", "We also faced difficulties. A winter storm in January damaged two subsea cables "
              "at Harrow Point, and repairs took six weeks. Insurance covered most of the cost, "
              "but the outage reduced output at that site for the first quarter. The lessons "
              "from that repair are described in the operations section of this report."),
    ],
    [
        ("h", "3. Operations"),
        ("p", "The chief engineer of the cooperative is Marta Okonkwo. "
              "She leads a team of twenty-eight engineers and technicians who inspect, repair "
              "and upgrade the turbines."),
        ("p", "Every turbine in the fleet is a Selkie T-40. "
              "It is a two-blade horizontal axis machine designed for shallow channels. Each "
              "one is rated at 1.2 megawatts and sits on the seabed without drilling, so it "
              "can be lifted for service in a single tide."),
        ("p", "The total installed capacity is 48 megawatts. "
              "It is spread over four tidal arrays, shown in the table below."),
        ("t", [
            ["Array", "Turbines", "Capacity (MW)", "Output (GWh)", "Availability (%)"],
            ["Gannet Reef", "16", "19.2", "54.3", "97.1"],
            ["Kestrel Sound", "12", "14.4", "40.1", "96.4"],
            ["Harrow Point", "8", "9.6", "23.8", "88.2"],
            ["Little Skerry", "4", "4.8", "13.6", "95.9"],
            ["Total", "40", "48.0", "131.8", "95.0"],
        ]),
        ("p", "The largest tidal array is Gannet Reef. "
              "It has sixteen turbines and produced forty percent of all electricity in 2025."),
        ("p", "Availability is the share of hours in which a turbine was ready to generate. "
              "The low figure for Harrow Point reflects the cable repair after the January "
              "storm. Without that event, fleet availability would have been above 96 percent."),
        ("p", "After the storm, the engineering team moved the export cables at Harrow Point "
              "into a sheltered gully and added a spare cable drum to the stores. A similar "
              "failure should now take days to repair, not weeks."),
    ],
    [
        ("h", "4. Finances"),
        ("p", "Revenue comes almost entirely from the sale of electricity. Members pay a fixed "
              "price per kilowatt-hour, set each year at the general meeting, and surplus "
              "electricity is sold to the regional grid under a fifteen-year contract. All "
              "figures below are in thousands of euros."),
        ("t", [
            ["Item", "2024", "2025", "Change (%)"],
            ["Electricity sales to members", "9,870", "10,640", "7.8"],
            ["Sales to the regional grid", "2,310", "2,705", "17.1"],
            ["Operating costs", "6,450", "6,820", "5.7"],
            ["Maintenance and repairs", "1,980", "2,240", "13.1"],
            ["Surplus returned to members", "1,150", "1,390", "20.9"],
        ]),
        ("p", "Operating costs grew more slowly than revenue. The main increase was in "
              "maintenance, driven by the cable repair at Harrow Point. The surplus is returned "
              "to members as a credit on their electricity bills in the following year."),
        ("p", "The cooperative has no bank debt. New turbines are paid for from a reserve fund "
              "that receives ten percent of each year's revenue, and from member bonds that pay "
              "a fixed rate of interest."),
        ("h", "5. Community and Safety"),
        ("p", "The cooperative funds a marine science prize at the district school and runs "
              "open days at the control room every summer. In 2025 more than 1,200 visitors "
              "toured the site. All divers renewed their offshore safety certificates, and the "
              "rescue boat crew completed four night exercises with the coastguard."),
    ],
    [
        ("h", "6. Outlook for 2026"),
        ("p", "The board plans to add six new turbines at Kestrel Sound in 2026, which will "
              "raise the installed capacity by 7.2 megawatts. Seabed surveys were finished in "
              "November, and the environmental permit is expected in the spring. Work at sea "
              "will be scheduled around the breeding season of the local seal colony."),
        ("p", "The cooperative will also test a battery store next to its substation. The "
              "battery will hold energy from the strongest tides and release it during the "
              "evening peak, when electricity is most valuable."),
        ("h", "7. Governance"),
        ("p", "The cooperative is governed by a board of nine directors elected by the members "
              "for three-year terms. Three seats are elected every year. Accounts are audited "
              "by an independent firm and presented to the members at the annual general "
              "meeting, which in 2026 will be held on 14 May in the town hall."),
        ("p", "Members may inspect the full accounts, the minutes of board meetings and the "
              "engineering safety reports at the cooperative office on any working day."),
    ],
]


class _Report(FPDF):
    """FPDF with the report's running footer."""

    def footer(self) -> None:
        self.set_y(-15)
        self.set_font("Helvetica", "", 9)
        self.cell(0, 6, f"Northwind Annual Report 2025 - page {self.page_no()}", align="C")


def build(path: Path) -> None:
    """Write the sample report to `path`.

    Args:
        path: Output PDF path.
    """
    pdf = _Report(format="A4")
    pdf.set_title(TITLE)
    pdf.set_author("Northwind Tidal Energy Cooperative")
    pdf.set_creator("longctx samples/make_report.py")
    pdf.set_creation_date(FIXED_DATE)
    pdf.set_auto_page_break(auto=True, margin=20)
    pdf.set_margins(20, 20, 20)
    for number, blocks in enumerate(PAGES, start=1):
        pdf.add_page()
        if number == 1:
            pdf.set_font("Helvetica", "B", 18)
            pdf.cell(0, 9, "Northwind Tidal Energy Cooperative", new_x="LMARGIN", new_y="NEXT")
            pdf.set_font("Helvetica", "B", 14)
            pdf.cell(0, 8, "Annual Report 2025", new_x="LMARGIN", new_y="NEXT")
            pdf.ln(4)
        for kind, body in blocks:
            if kind == "h":
                pdf.ln(2)
                pdf.set_font("Helvetica", "B", 13)
                pdf.cell(0, 8, str(body), new_x="LMARGIN", new_y="NEXT")
                pdf.ln(1)
            elif kind == "p":
                pdf.set_font("Helvetica", "", 11)
                pdf.multi_cell(0, 5.5, str(body), new_x="LMARGIN", new_y="NEXT")
                pdf.ln(3)
            else:
                pdf.set_font("Helvetica", "", 10)
                # Wide enough that no cell wraps: one table row stays one line of text.
                rows: list[list[str]] = body  # type: ignore[assignment]
                widths = (34, 22, 34, 34, 46) if len(rows[0]) == 5 else (70, 30, 30, 40)
                with pdf.table(col_widths=widths, text_align="LEFT", line_height=6.5) as table:
                    for row in rows:
                        table.row(row)
                pdf.ln(4)
    pdf.output(str(path))
    _check(path)


def _check(path: Path) -> None:
    """Fail loudly if a fact sentence does not come out of text extraction on one line.

    Args:
        path: The PDF just written.
    """
    text = "\n".join(page.extract_text() for page in PdfReader(path).pages)
    missing = [sentence for sentence, _, _ in FACTS if sentence not in text]
    if missing:
        raise SystemExit(f"fact sentences wrapped or lost in {path}: {missing}")


def main() -> None:
    """Build the report at the path given on the command line, or next to this script."""
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("report.pdf")
    build(out)


if __name__ == "__main__":
    main()
