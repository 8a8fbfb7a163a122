// The playground at GET / in headless Chromium (Debian's /usr/bin/chromium, or
// CHROMIUM_BIN), driven by playwright-core, against the real broker binary.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtemp, mkdir, rm, readFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join, resolve, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';
import { startBroker } from '../lib/broker.mjs';

const ARTIFACTS = resolve(dirname(fileURLToPath(import.meta.url)), '../../../target/playground');

let browser;
let profile;

before(async () => {
  profile = await mkdtemp(join(tmpdir(), 'codebroker-chromium-'));
  browser = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM_BIN || '/usr/bin/chromium',
    headless: true,
    args: [
      '--no-sandbox',
      '--disable-gpu',
      '--disable-quic',
      '--no-first-run',
      '--disable-background-networking',
      '--disable-component-update',
      '--disable-sync',
    ],
    viewport: { width: 1400, height: 1000 },
    acceptDownloads: true,
  });
  await mkdir(ARTIFACTS, { recursive: true });
});

after(async () => {
  await browser?.close();
  if (profile) await rm(profile, { recursive: true, force: true });
});

async function status(page) {
  return (await page.locator('#status').textContent()) ?? '';
}

async function runAndWait(page) {
  await page.click('#run');
  await page.waitForFunction(() => !document.querySelector('#run').disabled && document.querySelector('#status').textContent !== 'running…', null, {
    timeout: 120_000,
  });
}

test('with auth on: key once, Python prints and plots, session kept, upload and download', async (t) => {
  const broker = await startBroker({ auth: 'key' });
  t.after(() => broker.stop());
  const page = await browser.newPage();
  const problems = [];
  page.on('pageerror', (err) => problems.push(err.message));
  try {
    await page.goto(`${broker.root}/`);
    await page.waitForFunction(() => document.querySelector('#lang').options.length > 0);
    const languages = await page.$$eval('#lang option', (os) => os.map((o) => o.value));
    assert.ok(languages.includes('py') && languages.includes('bash'), languages.join(','));

    // Each language opens on its sample from the broker's language table.
    await page.selectOption('#lang', 'rs');
    assert.match(await page.inputValue('#code'), /hello from rs/);

    // Without the key the broker says 401 and the page asks for the key.
    await page.selectOption('#lang', 'bash');
    await page.fill('#code', 'echo hi');
    await runAndWait(page);
    assert.match(await status(page), /401/);
    assert.match((await page.locator('#key-state').textContent()) ?? '', /key needed/);

    // The key is entered once and survives a reload (localStorage).
    await page.fill('#api-key', broker.apiKey);
    await page.click('#save-key');
    await page.reload();
    await page.waitForFunction(() => document.querySelector('#lang').options.length > 0);
    assert.equal(await page.inputValue('#api-key'), broker.apiKey);

    await page.selectOption('#lang', 'py');
    await page.fill(
      '#code',
      [
        'import matplotlib.pyplot as plt',
        'answer = 6 * 7',
        'print("hello from the playground", answer)',
        'plt.plot([0, 1, 2, 3], [0, 1, 4, 9])',
        'plt.title("squares")',
        'plt.show()',
      ].join('\n'),
    );
    await runAndWait(page);
    assert.match(await status(page), /exit 0/, await status(page));
    assert.match(await page.locator('#output pre.stdout').first().textContent(), /hello from the playground 42/);
    // The figure shows inline in the output, decoded by the browser.
    const figure = page.locator('#output img').first();
    await figure.waitFor();
    assert.ok((await figure.evaluate((img) => img.complete && img.naturalWidth)) > 100);
    // And in the file list, fetched with the key.
    const fileImage = page.locator('#files li img').first();
    await fileImage.waitFor();
    await page.waitForFunction(() => {
      const img = document.querySelector('#files li img');
      return img && img.complete && img.naturalWidth > 100;
    });
    const session = await page.locator('#session').textContent();
    assert.match(session ?? '', /^[A-Za-z0-9_-]{10,}$/);
    await page.screenshot({ path: join(ARTIFACTS, 'screenshot.png'), fullPage: true });

    // The next run is in the same session: the variable is still there.
    await page.fill('#code', 'print("again", answer + 1)');
    await runAndWait(page);
    assert.match(await page.locator('#output pre.stdout').first().textContent(), /again 43/);
    assert.equal(await page.locator('#session').textContent(), session);
    // And after a reload too.
    await page.reload();
    await page.waitForFunction(() => document.querySelector('#lang').options.length > 0);
    assert.equal(await page.locator('#session').textContent(), session);

    // Upload a file into the session, read it from code, download it back.
    await page.setInputFiles('#upload', {
      name: 'table.csv',
      mimeType: 'text/csv',
      buffer: Buffer.from('a,b\n1,2\n3,4\n'),
    });
    await page.locator('#files li[data-name="table.csv"]').waitFor();
    await page.selectOption('#lang', 'py');
    await page.fill('#code', 'import pandas as pd\nprint(pd.read_csv("/mnt/data/table.csv")["b"].sum())');
    await runAndWait(page);
    assert.match(await page.locator('#output pre.stdout').first().textContent(), /^6\s*$/);
    const [download] = await Promise.all([
      page.waitForEvent('download'),
      page.locator('#files li[data-name="table.csv"] button').click(),
    ]);
    assert.equal(download.suggestedFilename(), 'table.csv');
    assert.equal(await readFile(await download.path(), 'utf8'), 'a,b\n1,2\n3,4\n');
    assert.deepEqual(problems, []);
  } catch (err) {
    await page.screenshot({ path: join(ARTIFACTS, 'failure-auth.png'), fullPage: true }).catch(() => {});
    process.stderr.write(await broker.log());
    throw err;
  } finally {
    await page.close();
  }
});

test('with auth off: no key needed, output streams while the code runs, keep-alives pass unseen', async (t) => {
  // A keep-alive comment every second: the 2 s sleep below gets at least one.
  const broker = await startBroker({ auth: 'none', env: { CODEBROKER_STREAM_KEEPALIVE_SECS: '1' } });
  t.after(() => broker.stop());
  const page = await browser.newPage();
  try {
    await page.goto(`${broker.root}/`);
    // A key saved for another broker on this origin must not be needed; start clean.
    await page.evaluate(() => localStorage.clear());
    await page.reload();
    await page.waitForFunction(() => document.querySelector('#lang').options.length > 0);
    await page.selectOption('#lang', 'py');
    await page.fill('#code', 'import time\nprint("first", flush=True)\ntime.sleep(2)\nprint("second")');
    await page.click('#run');
    // "first" shows while the code still sleeps.
    await page.waitForFunction(() => (document.querySelector('#output pre.stdout')?.textContent ?? '').includes('first'), null, {
      timeout: 60_000,
    });
    assert.equal(await status(page), 'running…');
    assert.doesNotMatch(await page.locator('#output pre.stdout').first().textContent(), /second/);
    await page.waitForFunction(() => document.querySelector('#status').textContent.includes('exit 0'), null, {
      timeout: 60_000,
    });
    assert.match(await page.locator('#output pre.stdout').first().textContent(), /first\nsecond/);
  } catch (err) {
    await page.screenshot({ path: join(ARTIFACTS, 'failure-noauth.png'), fullPage: true }).catch(() => {});
    process.stderr.write(await broker.log());
    throw err;
  } finally {
    await page.close();
  }
});
