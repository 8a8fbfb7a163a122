//! What chat users ask a code interpreter for: Word, PowerPoint, Excel and PDF files, made
//! by the image's document stack (sandbox-image/Dockerfile, "Documents and office files").
//! Each test makes a file in one exec and reopens it in a second exec of the same session
//! with a reader that did not write it (pandoc, openpyxl, pypdf, python-pptx, zip and XML),
//! and downloads it with the content type a browser needs to open it.

mod common;

use common::{session, stderr, stdout, TestBroker};
use serde_json::Value;

const DOCX: &str = "application/vnd.openxmlformats-officedocument.wordprocessingml.document";
const PPTX: &str = "application/vnd.openxmlformats-officedocument.presentationml.presentation";
const XLSX: &str = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet";
const PDF: &str = "application/pdf";
const PNG: &str = "image/png";

/// Runs `code` and insists it exited 0.
async fn ok(broker: &TestBroker, lang: &str, code: &str, session_id: Option<&str>) -> Value {
    let resp = broker.run(lang, code, session_id).await;
    assert_eq!(resp["exit_code"], 0, "{resp}");
    resp
}

/// The file `name` the exec harvested: downloads it and checks its content type (in the
/// download and in the listing) and its first bytes.
async fn downloaded(broker: &TestBroker, resp: &Value, name: &str, mime: &str, magic: &[u8]) {
    let s = session(resp);
    let files = resp["files"].as_array().expect("files");
    let file = files
        .iter()
        .find(|f| f["name"] == name)
        .unwrap_or_else(|| panic!("{name} was not harvested: {resp}"));
    let id = file["id"].as_str().expect("id");
    let dl = broker.get(&format!("/download/{s}/{id}")).await;
    assert_eq!(dl.status(), 200, "{name}");
    let ct = dl.headers()["content-type"]
        .to_str()
        .unwrap_or("")
        .to_string();
    assert_eq!(ct, mime, "{name}");
    let body = dl.bytes().await.expect("body");
    assert!(
        body.starts_with(magic),
        "{name} starts {:?}",
        &body[..body.len().min(8)]
    );
    // The listing LibreChat's client reads carries the same type.
    let listed: Value = broker
        .get(&format!("/files/{s}?detail=full"))
        .await
        .json()
        .await
        .expect("files json");
    let entry = listed
        .as_array()
        .expect("listing")
        .iter()
        .find(|f| f["metadata"]["original-filename"] == name)
        .unwrap_or_else(|| panic!("{name} not listed: {listed}"));
    assert_eq!(entry["contentType"], mime, "{entry}");
}

const ZIP: &[u8] = b"PK\x03\x04";

#[tokio::test]
async fn a_word_report_with_a_heading_and_a_table_reads_back_in_pandoc() {
    let broker = TestBroker::start("doc-docx").await;
    let made = ok(
        &broker,
        "py",
        r#"
from docx import Document
doc = Document()
doc.add_heading('Quarterly Report', level=1)
doc.add_paragraph('Sales grew in every region.')
table = doc.add_table(rows=3, cols=2)
for r, (region, amount) in enumerate([('Region', 'Sales'), ('North', '120'), ('South', '95')]):
    table.cell(r, 0).text, table.cell(r, 1).text = region, amount
doc.save('report.docx')
print('saved')
"#,
        None,
    )
    .await;
    assert_eq!(stdout(&made), "saved\n", "{made}");
    downloaded(&broker, &made, "report.docx", DOCX, ZIP).await;

    let s = session(&made);
    let read = ok(&broker, "bash", "pandoc report.docx -t markdown", Some(&s)).await;
    let md = stdout(&read);
    assert!(md.contains("# Quarterly Report"), "{read}");
    assert!(md.contains("Sales grew in every region."), "{read}");
    assert!(
        md.contains("North") && md.contains("120") && md.contains("South"),
        "{read}"
    );
    // markitdown, which skills use to read what users upload, sees the table as one.
    let read = ok(
        &broker,
        "py",
        "from markitdown import MarkItDown\nprint(MarkItDown().convert('report.docx').text_content)",
        Some(&s),
    )
    .await;
    assert!(stdout(&read).contains("| North | 120 |"), "{read}");
}

#[tokio::test]
async fn a_powerpoint_with_two_slides_and_a_chart_has_both_in_the_package() {
    let broker = TestBroker::start("doc-pptx").await;
    let made = ok(
        &broker,
        "py",
        r#"
from pptx import Presentation
from pptx.chart.data import CategoryChartData
from pptx.enum.chart import XL_CHART_TYPE
from pptx.util import Inches
prs = Presentation()
title = prs.slides.add_slide(prs.slide_layouts[0])
title.shapes.title.text = 'Results 2026'
title.placeholders[1].text = 'Prepared by the analytics team'
chart_slide = prs.slides.add_slide(prs.slide_layouts[5])
chart_slide.shapes.title.text = 'Sales by region'
data = CategoryChartData()
data.categories = ['North', 'South', 'East']
data.add_series('Sales', (120, 95, 70))
chart_slide.shapes.add_chart(XL_CHART_TYPE.COLUMN_CLUSTERED, Inches(1), Inches(1.5), Inches(8), Inches(5), data)
prs.save('deck.pptx')
"#,
        None,
    )
    .await;
    downloaded(&broker, &made, "deck.pptx", PPTX, ZIP).await;

    let s = session(&made);
    let read = ok(
        &broker,
        "py",
        r#"
import re, zipfile
from lxml import etree
z = zipfile.ZipFile('deck.pptx')
slides = sorted(n for n in z.namelist() if re.fullmatch(r'ppt/slides/slide\d+\.xml', n))
charts = [n for n in z.namelist() if re.fullmatch(r'ppt/charts/chart\d+\.xml', n)]
print(len(slides), 'slides', len(charts), 'chart')
ns = {'a': 'http://schemas.openxmlformats.org/drawingml/2006/main',
      'c': 'http://schemas.openxmlformats.org/drawingml/2006/chart'}
for n in slides:
    print(' / '.join(t.text for t in etree.fromstring(z.read(n)).iterfind('.//a:t', ns)))
chart = etree.fromstring(z.read(charts[0]))
print([v.text for v in chart.iterfind('.//c:cat//c:v', ns)], [v.text for v in chart.iterfind('.//c:val//c:v', ns)])
"#,
        Some(&s),
    )
    .await;
    assert_eq!(
        stdout(&read),
        "2 slides 1 chart\nResults 2026 / Prepared by the analytics team\nSales by region\n\
         ['North', 'South', 'East'] ['120', '95', '70']\n",
        "{read}"
    );
}

#[tokio::test]
async fn an_excel_sheet_keeps_its_formula_and_chart_and_libreoffice_computes_the_formula() {
    let broker = TestBroker::start("doc-xlsx").await;
    let made = ok(
        &broker,
        "py",
        r#"
import xlsxwriter
wb = xlsxwriter.Workbook('sales.xlsx')
ws = wb.add_worksheet('Sales')
ws.write_row('A1', ['Region', 'Sales'])
for i, (region, amount) in enumerate([('North', 120), ('South', 95), ('East', 70)], start=2):
    ws.write(f'A{i}', region)
    ws.write(f'B{i}', amount)
ws.write('A5', 'Total')
ws.write_formula('B5', '=SUM(B2:B4)')
chart = wb.add_chart({'type': 'column'})
chart.add_series({'name': 'Sales', 'categories': '=Sales!$A$2:$A$4', 'values': '=Sales!$B$2:$B$4'})
ws.insert_chart('D2', chart)
wb.close()
"#,
        None,
    )
    .await;
    downloaded(&broker, &made, "sales.xlsx", XLSX, ZIP).await;

    let s = session(&made);
    let read = ok(
        &broker,
        "py",
        r#"
import zipfile
from openpyxl import load_workbook
ws = load_workbook('sales.xlsx')['Sales']
print(ws['A5'].value, ws['B5'].value)
print([n for n in zipfile.ZipFile('sales.xlsx').namelist() if n.startswith('xl/charts/')])
"#,
        Some(&s),
    )
    .await;
    assert_eq!(
        stdout(&read),
        "Total =SUM(B2:B4)\n['xl/charts/chart1.xml']\n",
        "{read}"
    );
    // XlsxWriter stores no computed values (0); LibreOffice recalculates on load (the
    // image's codebroker.xcd) and computes 285.
    let calc = ok(
        &broker,
        "bash",
        "soffice --headless --convert-to csv --outdir /tmp/calc sales.xlsx >/dev/null 2>&1; cat /tmp/calc/sales.csv",
        Some(&s),
    )
    .await;
    assert!(stdout(&calc).contains("Total,285"), "{calc}");
}

#[tokio::test]
async fn a_reportlab_pdf_has_the_text_pypdf_and_pdfplumber_read_back() {
    let broker = TestBroker::start("doc-pdf").await;
    let made = ok(
        &broker,
        "py",
        r#"
from reportlab.lib.pagesizes import A4
from reportlab.platypus import SimpleDocTemplate, Paragraph, Table, TableStyle
from reportlab.lib import colors
from reportlab.lib.styles import getSampleStyleSheet
styles = getSampleStyleSheet()
SimpleDocTemplate('summary.pdf', pagesize=A4).build([
    Paragraph('Invoice 2026-117', styles['Title']),
    Paragraph('Total due: 1,250.00 EUR', styles['Normal']),
    Table([['Item', 'Qty'], ['Widget', '5']],
          style=TableStyle([('GRID', (0, 0), (-1, -1), 0.5, colors.black)])),
])
"#,
        None,
    )
    .await;
    downloaded(&broker, &made, "summary.pdf", PDF, b"%PDF-").await;

    let s = session(&made);
    let read = ok(
        &broker,
        "py",
        r#"
from pypdf import PdfReader
import pdfplumber
reader = PdfReader('summary.pdf')
print(len(reader.pages), 'page')
print(reader.pages[0].extract_text())
with pdfplumber.open('summary.pdf') as pdf:
    print(pdf.pages[0].extract_tables())
"#,
        Some(&s),
    )
    .await;
    let text = stdout(&read);
    assert!(text.starts_with("1 page\n"), "{read}");
    assert!(text.contains("Invoice 2026-117"), "{read}");
    assert!(text.contains("Total due: 1,250.00 EUR"), "{read}");
    assert!(
        text.contains("[[['Item', 'Qty'], ['Widget', '5']]]"),
        "{read}"
    );
}

#[tokio::test]
async fn libreoffice_converts_a_word_file_to_pdf_and_a_pdf_page_renders_to_png() {
    let broker = TestBroker::start("doc-convert").await;
    let made = ok(
        &broker,
        "py",
        r#"
from docx import Document
doc = Document()
doc.add_heading('Meeting notes', level=1)
doc.add_paragraph('Decision: ship on Friday.')
doc.save('notes.docx')
"#,
        None,
    )
    .await;
    let s = session(&made);
    // As a skill does it: LibreOffice headless from a shell, its profile in /tmp.
    let converted = ok(
        &broker,
        "bash",
        "soffice --headless --convert-to pdf notes.docx >/dev/null 2>&1; ls notes.pdf",
        Some(&s),
    )
    .await;
    assert_eq!(stdout(&converted), "notes.pdf\n", "{converted}");
    downloaded(&broker, &converted, "notes.pdf", PDF, b"%PDF-").await;

    let rendered = ok(
        &broker,
        "py",
        r#"
from pypdf import PdfReader
from pdf2image import convert_from_path
print(PdfReader('notes.pdf').pages[0].extract_text().splitlines()[:2])
page = convert_from_path('notes.pdf', dpi=50, first_page=1, last_page=1)[0]
page.save('notes-page1.png')
print(page.size[0] > 300, page.size[1] > page.size[0])
"#,
        Some(&s),
    )
    .await;
    assert_eq!(
        stdout(&rendered),
        "['Meeting notes', 'Decision: ship on Friday.']\nTrue True\n",
        "{rendered}"
    );
    downloaded(
        &broker,
        &rendered,
        "notes-page1.png",
        PNG,
        b"\x89PNG\r\n\x1a\n",
    )
    .await;
    // The PNG is a page, not a blank: pdftoppm drew the heading's dark pixels.
    let check = ok(
        &broker,
        "py",
        "from PIL import Image\nim = Image.open('notes-page1.png').convert('L')\nprint(min(im.getdata()) < 100, max(im.getdata()) > 200)",
        Some(&s),
    )
    .await;
    assert_eq!(stdout(&check), "True True\n", "{check}");
}

#[tokio::test]
async fn javascript_makes_a_deck_with_pptxgenjs_and_a_sheet_with_exceljs_by_require_and_import() {
    let broker = TestBroker::start("doc-js").await;
    // require from the exec's own script, as the js language runs it.
    let deck = ok(
        &broker,
        "js",
        r#"
const PptxGenJS = require('pptxgenjs');
const pptx = new PptxGenJS();
pptx.addSlide().addText('Hello from pptxgenjs', { x: 1, y: 1, fontSize: 24 });
const chart = pptx.addSlide();
chart.addChart(pptx.ChartType.bar, [{ name: 'Sales', labels: ['N', 'S'], values: [120, 95] }], { x: 1, y: 1, w: 6, h: 4 });
pptx.writeFile({ fileName: '/mnt/data/js-deck.pptx' }).then((f) => console.log('wrote', f));
"#,
        None,
    )
    .await;
    assert_eq!(stdout(&deck), "wrote /mnt/data/js-deck.pptx\n", "{deck}");
    downloaded(&broker, &deck, "js-deck.pptx", PPTX, ZIP).await;
    let s = session(&deck);

    // import from a module in /mnt/data, which has no node_modules of its own.
    let sheet = ok(
        &broker,
        "bash",
        r#"cat > make-sheet.mjs <<'EOF'
import ExcelJS from 'exceljs';
const wb = new ExcelJS.Workbook();
const ws = wb.addWorksheet('Data');
ws.addRow(['a', 'b', 'sum']);
ws.addRow([2, 3, { formula: 'A2+B2', result: 5 }]);
await wb.xlsx.writeFile('js-sheet.xlsx');
console.log('wrote js-sheet.xlsx');
EOF
node make-sheet.mjs"#,
        Some(&s),
    )
    .await;
    assert_eq!(stdout(&sheet), "wrote js-sheet.xlsx\n", "{sheet}");
    downloaded(&broker, &sheet, "js-sheet.xlsx", XLSX, ZIP).await;

    let read = ok(
        &broker,
        "py",
        r#"
from pptx import Presentation
from openpyxl import load_workbook
prs = Presentation('js-deck.pptx')
print(len(prs.slides), [s.has_chart for s in prs.slides[1].shapes])
print(next(sh.text_frame.text for sh in prs.slides[0].shapes if sh.has_text_frame))
ws = load_workbook('js-sheet.xlsx')['Data']
print([c.value for c in ws[2]])
"#,
        Some(&s),
    )
    .await;
    assert_eq!(
        stdout(&read),
        "2 [True]\nHello from pptxgenjs\n[2, 3, '=A2+B2']\n",
        "{read}"
    );
}

#[tokio::test]
async fn docx_pdf_lib_and_mammoth_round_trip_in_node() {
    let broker = TestBroker::start("doc-node").await;
    let made = ok(
        &broker,
        "js",
        r#"
const fs = require('fs');
const { Document, Packer, Paragraph, HeadingLevel } = require('docx');
const { PDFDocument, StandardFonts } = require('pdf-lib');
(async () => {
  const doc = new Document({ sections: [{ children: [
    new Paragraph({ text: 'Made by docx', heading: HeadingLevel.HEADING_1 }),
    new Paragraph('A paragraph for mammoth.'),
  ] }] });
  fs.writeFileSync('/mnt/data/node.docx', await Packer.toBuffer(doc));
  const pdf = await PDFDocument.create();
  const page = pdf.addPage();
  page.drawText('Made by pdf-lib', { x: 50, y: 700, font: await pdf.embedFont(StandardFonts.Helvetica) });
  fs.writeFileSync('/mnt/data/node.pdf', await pdf.save());
  const html = (await require('mammoth').convertToHtml({ path: '/mnt/data/node.docx' })).value;
  console.log(html);
})();
"#,
        None,
    )
    .await;
    assert_eq!(
        stdout(&made),
        "<h1>Made by docx</h1><p>A paragraph for mammoth.</p>\n",
        "{made}"
    );
    downloaded(&broker, &made, "node.docx", DOCX, ZIP).await;
    downloaded(&broker, &made, "node.pdf", PDF, b"%PDF-").await;
    let s = session(&made);
    let read = ok(
        &broker,
        "py",
        "from pypdf import PdfReader\nprint(PdfReader('node.pdf').pages[0].extract_text())",
        Some(&s),
    )
    .await;
    assert_eq!(stdout(&read).trim(), "Made by pdf-lib", "{read}");
}

#[tokio::test]
async fn the_data_stack_beyond_pandas_is_there_plotly_statsmodels_pyarrow_tabulate() {
    let broker = TestBroker::start("doc-data").await;
    let resp = ok(
        &broker,
        "py",
        r#"
import pandas as pd, numpy as np
import plotly.express as px, statsmodels.api as sm, pyarrow.parquet as pq, pyarrow as pa
from tabulate import tabulate
from bs4 import BeautifulSoup
df = pd.DataFrame({'x': np.arange(10.0), 'y': 2 * np.arange(10.0) + 1})
fit = sm.OLS(df['y'], sm.add_constant(df['x'])).fit()
print(round(fit.params['x'], 6), round(fit.params['const'], 6))
pq.write_table(pa.Table.from_pandas(df), 'points.parquet')
print(pq.read_table('points.parquet').num_rows)
px.scatter(df, x='x', y='y').write_html('scatter.html', include_plotlyjs=False)
print(tabulate([[1, 2]], headers=['a', 'b'], tablefmt='github').splitlines()[0].replace(' ', ''))
print(BeautifulSoup('<p>soup</p>', 'lxml').p.text)
"#,
        None,
    )
    .await;
    assert_eq!(
        stdout(&resp),
        "2.0 1.0\n10\n|a|b|\nsoup\n",
        "{resp} {}",
        stderr(&resp)
    );
    downloaded(
        &broker,
        &resp,
        "points.parquet",
        "application/vnd.apache.parquet",
        b"PAR1",
    )
    .await;
    downloaded(
        &broker,
        &resp,
        "scatter.html",
        "text/html; charset=utf-8",
        b"<html>",
    )
    .await;
}

#[tokio::test]
async fn libraries_lists_the_document_stack() {
    let broker = TestBroker::start("doc-libraries").await;
    let libs: Value = broker.get("/libraries").await.json().await.expect("json");
    let names = |lang: &str| -> Vec<String> {
        libs[lang]["packages"]
            .as_array()
            .unwrap_or_else(|| panic!("{lang} in {libs}"))
            .iter()
            .filter_map(|p| p["name"].as_str().map(str::to_ascii_lowercase))
            .collect()
    };
    let py = names("py");
    for want in [
        "python-docx",
        "python-pptx",
        "xlsxwriter",
        "openpyxl",
        "reportlab",
        "pypdf",
        "pdfplumber",
        "pdf2image",
        "plotly",
        "markitdown",
        "statsmodels",
        "pyarrow",
        "tabulate",
        "beautifulsoup4",
        "lxml",
        "pandas",
        "numpy",
        "matplotlib",
    ] {
        assert!(py.contains(&want.to_string()), "py lacks {want}: {py:?}");
    }
    for lang in ["js", "ts"] {
        let js = names(lang);
        for want in ["pptxgenjs", "exceljs", "docx", "pdf-lib", "mammoth"] {
            assert!(
                js.contains(&want.to_string()),
                "{lang} lacks {want}: {js:?}"
            );
        }
    }
    let tools = names("bash");
    for want in ["libreoffice", "pandoc", "poppler-utils"] {
        assert!(
            tools.contains(&want.to_string()),
            "bash lacks {want}: {tools:?}"
        );
    }
}
