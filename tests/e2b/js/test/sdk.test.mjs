// E2B's JavaScript SDK (@e2b/code-interpreter over e2b) against codebroker, pointed at it the
// documented way: E2B_API_URL, E2B_SANDBOX_URL and a codebroker API key as E2B_API_KEY.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { startBroker } from '../../../node-common/broker.mjs';

let broker;
let Sandbox;
let BaseSandbox;

before(async () => {
  broker = await startBroker({ name: 'e2b-js', poolSize: '1' });
  process.env.E2B_API_URL = `${broker.root}/e2b`;
  process.env.E2B_SANDBOX_URL = `${broker.root}/e2b/sandbox`;
  process.env.E2B_API_KEY = broker.apiKey;
  delete process.env.E2B_DOMAIN;
  // Read at import: the SDK's connection settings come from the environment above.
  ({ Sandbox } = await import('@e2b/code-interpreter'));
  ({ Sandbox: BaseSandbox } = await import('e2b'));
});

after(async () => {
  await broker?.stop();
});

test('runCode keeps state, streams output and returns results and errors', async () => {
  const sbx = await Sandbox.create({ timeoutMs: 120_000 });
  try {
    const seen = [];
    const first = await sbx.runCode("import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(0.3)\nx = 41", {
      onStdout: (m) => seen.push([Date.now(), m.line]),
    });
    assert.equal(first.error, undefined);
    assert.deepEqual(seen.map(([, line]) => line), ['tick 0\n', 'tick 1\n', 'tick 2\n']);
    // Streamed as the code ran, not all at the end.
    assert.ok(seen[2][0] - seen[0][0] >= 400, `ticks arrived together: ${JSON.stringify(seen)}`);
    const second = await sbx.runCode('x + 1');
    assert.equal(second.text, '42');
    const failed = await sbx.runCode("raise ValueError('nope')");
    assert.equal(failed.error.name, 'ValueError');
    assert.equal(failed.error.value, 'nope');
    const plot = await sbx.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()');
    assert.ok(plot.results.some((r) => typeof r.png === 'string' && r.png.length > 100), JSON.stringify(plot.results));
    const table = await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2]})");
    assert.match(table.results[0].html, /<table/);
    const bash = await sbx.runCode('echo from bash', { language: 'bash' });
    assert.deepEqual(bash.logs.stdout, ['from bash\n']);
    const js = await sbx.runCode('console.log(6 * 7)', { language: 'javascript' });
    assert.deepEqual(js.logs.stdout, ['42\n']);
  } finally {
    await sbx.kill();
  }
});

test('files: text and 1 MiB of binary written, read, listed; commands with exit codes', async () => {
  const sbx = await BaseSandbox.create();
  try {
    await sbx.files.write('/home/user/notes.txt', 'hello');
    assert.equal(await sbx.files.read('/home/user/notes.txt'), 'hello');
    const binary = new Uint8Array(1024 * 1024);
    for (let i = 0; i < binary.length; i++) binary[i] = (i * 7) & 0xff;
    await sbx.files.write('/home/user/data/blob.bin', binary.buffer);
    const back = await sbx.files.read('/home/user/data/blob.bin', { format: 'bytes' });
    assert.equal(back.length, binary.length);
    assert.ok(Buffer.from(back).equals(Buffer.from(binary)));
    const listed = await sbx.files.list('/home/user/data');
    assert.deepEqual(listed.map((e) => [e.name, e.type, e.size]), [['blob.bin', 'file', 1024 * 1024]]);
    assert.equal(await sbx.files.exists('/home/user/notes.txt'), true);
    assert.equal(await sbx.files.exists('/home/user/absent.txt'), false);
    const run = await sbx.commands.run('sha256sum data/blob.bin | cut -c1-16; echo warn >&2');
    assert.equal(run.exitCode, 0);
    assert.equal(run.stderr, 'warn\n');
    await assert.rejects(sbx.commands.run('exit 7'), (err) => err.exitCode === 7);
    // A second client connects by id and sees the same sandbox.
    const other = await BaseSandbox.connect(sbx.sandboxId);
    assert.equal(await other.files.read('/home/user/notes.txt'), 'hello');
    // No network inside.
    const net = await sbx.commands.run('python3 -c "import urllib.request; urllib.request.urlopen(\'http://1.1.1.1\', timeout=3)"').catch((e) => e);
    assert.notEqual(net.exitCode, 0);
  } finally {
    await sbx.kill();
  }
});

test('list, timeout, kill; another key is refused', async () => {
  const sbx = await BaseSandbox.create({ metadata: { suite: 'js' } });
  const paginator = BaseSandbox.list({ query: { metadata: { suite: 'js' } } });
  const items = await paginator.nextItems();
  assert.deepEqual(items.map((s) => s.sandboxId), [sbx.sandboxId]);
  await sbx.setTimeout(30_000);
  const info = await sbx.getInfo();
  assert.ok(new Date(info.endAt) - Date.now() <= 31_000);
  await assert.rejects(
    BaseSandbox.create({ apiKey: 'not-a-key' }),
    (err) => /401|auth|key/i.test(`${err.name} ${err.message}`),
  );
  await assert.rejects(BaseSandbox.connect(sbx.sandboxId, { apiKey: 'not-a-key' }));
  assert.equal(await sbx.kill(), true);
  assert.equal(await BaseSandbox.kill(sbx.sandboxId), false);
  assert.equal(await sbx.isRunning(), false);
});
