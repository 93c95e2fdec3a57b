// `rewind serve` driven by the official OpenAI client (the `openai` npm
// package pinned by package-lock.json): starts the server on a free port of
// 127.0.0.1, checks completions with and without streaming against
// `rewind generate` on the same prompt, the error statuses the client maps
// to its error classes, concurrent streams, and that SIGTERM drains and
// exits 0. Then chat completions (with and without streaming) on a copy of
// the model with a chat template, against `rewind generate` on the prompt
// the template renders.
//
//   node tests/server/openai_client_test.mjs REWIND_BINARY MODEL_DIR
//
// Exits 77 (ctest's SKIP_RETURN_CODE) when tests/server/node_modules has no
// openai package (`make server-client` installs it), 1 then when
// REWIND_REQUIRE_OPENAI_CLIENT=1 (as `make test` sets).
import assert from 'node:assert/strict';
import { execFileSync, spawn } from 'node:child_process';
import { copyFileSync, existsSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
if (!existsSync(join(here, 'node_modules', 'openai'))) {
  // `make test` installs it and sets REWIND_REQUIRE_OPENAI_CLIENT: a skip there would hide the test.
  const required = process.env.REWIND_REQUIRE_OPENAI_CLIENT === '1';
  console.log(`${required ? 'failed' : 'skipped'}: tests/server/node_modules/openai is not installed (cd tests/server && npm ci)`);
  process.exit(required ? 1 : 77);
}
const { default: OpenAI } = await import('openai');

const [rewind, modelDir] = process.argv.slice(2);
if (!rewind || !modelDir) {
  console.error('usage: node openai_client_test.mjs REWIND_BINARY MODEL_DIR');
  process.exit(2);
}

// What `rewind generate` prints for the prompt alone (greedy), without its final newline.
function solo(prompt, n) {
  const out = execFileSync(rewind, ['generate', '-m', modelDir, '-p', prompt, '-n', String(n)]).toString();
  return out.endsWith('\n') ? out.slice(0, -1) : out;
}

// Starts `rewind serve` on a free port; resolves once it listens.
async function startServer(dir) {
  const proc = spawn(rewind, ['serve', '-m', dir, '--port', '0', '--max-batch', '3'], {
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  const srv = { proc, log: '' };
  srv.exited = new Promise((resolve) => proc.on('exit', (code, signal) => resolve({ code, signal })));
  srv.port = await new Promise((resolve, reject) => {
    proc.stderr.on('data', (d) => {
      srv.log += d;
      const m = srv.log.match(/http:\/\/[^\s:]+:(\d+)/);
      if (m) resolve(Number(m[1]));
    });
    srv.exited.then(({ code }) => reject(new Error(`rewind serve exited (${code}) before listening:\n${srv.log}`)));
  });
  return srv;
}

// SIGTERM drains and exits 0.
async function stopServer(srv) {
  srv.proc.kill('SIGTERM');
  const { code, signal } = await srv.exited;
  assert.equal(signal, null, `rewind serve died of ${signal}:\n${srv.log}`);
  assert.equal(code, 0, `rewind serve exited ${code} after SIGTERM:\n${srv.log}`);
}

const srv = await startServer(modelDir);
const port = srv.port;

const client = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: 'unused', maxRetries: 0 });
const model = 'kjv-hybrid';
let checks = 0;

async function streamText(params) {
  const stream = await client.completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
  let text = '';
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    for (const choice of chunk.choices) {
      text += choice.text;
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    if (chunk.usage && chunk.choices.length === 0) usage = chunk.usage;
  }
  return { text, finish, usage };
}

try {
  const models = await client.models.list();
  assert.deepEqual(
    models.data.map((m) => m.id),
    [model],
  );
  ++checks;

  const prompts = ['In the beginning', 'And God said, Let there be light', 'The LORD is my shepherd;', 'Blessed are'];
  const expected = prompts.map((p) => solo(p, 32));

  const r = await client.completions.create({ model, prompt: prompts[0], max_tokens: 32, temperature: 0 });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices[0].text, expected[0]);
  assert.equal(r.usage.completion_tokens, 32);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 32);
  ++checks;

  const s = await streamText({ model, prompt: prompts[1], max_tokens: 32, temperature: 0 });
  assert.equal(s.text, expected[1]);
  assert.equal(s.finish, 'length');
  assert.equal(s.usage.completion_tokens, 32);
  ++checks;

  // More concurrent streams than --max-batch: some wait and join the batch.
  const all = await Promise.all(
    [...prompts, ...prompts].map((prompt) => streamText({ model, prompt, max_tokens: 32, temperature: 0 })),
  );
  all.forEach((res, i) => assert.equal(res.text, expected[i % prompts.length], `concurrent stream ${i}`));
  ++checks;

  const stop = expected[0].slice(10, 13);
  const cut = await client.completions.create({ model, prompt: prompts[0], max_tokens: 32, temperature: 0, stop: [stop] });
  assert.equal(cut.choices[0].text, expected[0].slice(0, expected[0].indexOf(stop)));
  assert.equal(cut.choices[0].finish_reason, 'stop');
  ++checks;

  // n = 3 choices forked from one prefill: greedy, each equals generate; streamed, chunks interleave by index.
  const three = await client.completions.create({ model, prompt: prompts[2], max_tokens: 32, temperature: 0, n: 3 });
  assert.deepEqual(three.choices.map((c) => [c.index, c.text, c.finish_reason]), [0, 1, 2].map((i) => [i, expected[2], 'length']));
  assert.equal(three.usage.completion_tokens, 3 * 32);
  const threeStream = await client.completions.create({ model, prompt: prompts[2], max_tokens: 32, temperature: 0, n: 3, stream: true });
  const texts = ['', '', ''];
  for await (const chunk of threeStream) for (const c of chunk.choices) texts[c.index] += c.text;
  assert.deepEqual(texts, [expected[2], expected[2], expected[2]]);
  ++checks;

  await assert.rejects(client.completions.create({ model: 'no-such-model', prompt: 'x' }), (e) => {
    assert.ok(e instanceof OpenAI.NotFoundError, String(e));
    assert.equal(e.code, 'model_not_found');
    return true;
  });
  await assert.rejects(client.completions.create({ model, prompt: 'x', max_tokens: 'many' }), (e) => {
    assert.ok(e instanceof OpenAI.BadRequestError, String(e));
    assert.equal(e.param, 'max_tokens');
    return true;
  });
  await assert.rejects(
    client.chat.completions.create({ model, messages: [{ role: 'user', content: 'hi' }] }),
    (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError, String(e));
      assert.equal(e.code, 'chat_template_unsupported');
      return true;
    },
  );
  ++checks;
} finally {
  await stopServer(srv);
}
++checks;

// ---- chat: the model beside a tokenizer_config.json with a template ----
const chatDir = mkdtempSync(join(tmpdir(), 'rewind-chat-'));
copyFileSync(join(modelDir, 'config.json'), join(chatDir, 'config.json'));
symlinkSync(resolve(modelDir, 'model.safetensors'), join(chatDir, 'model.safetensors'));
writeFileSync(
  join(chatDir, 'tokenizer_config.json'),
  JSON.stringify({
    chat_template:
      "{%- for m in messages %}{{ m.role }}: {{ m.content | trim }}{{ '\\n' }}{%- endfor %}" +
      "{%- if add_generation_prompt %}assistant:{% endif %}",
  }),
);
const chatSrv = await startServer(chatDir);
try {
  const chat = new OpenAI({ baseURL: `http://127.0.0.1:${chatSrv.port}/v1`, apiKey: 'unused', maxRetries: 0 });
  const messages = [
    { role: 'system', content: ' Answer from the book. ' },
    { role: 'user', content: 'In the beginning' },
  ];
  // The template's text, written out: `rewind generate` puts BOS first, as the server does.
  const expected = solo('system: Answer from the book.\nuser: In the beginning\nassistant:', 24);

  const r = await chat.chat.completions.create({ messages, max_tokens: 24, temperature: 0 });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(r.choices[0].message.content, expected);
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 24);
  ++checks;

  const stream = await chat.chat.completions.create({
    messages,
    max_tokens: 24,
    temperature: 0,
    stream: true,
    stream_options: { include_usage: true },
  });
  let text = '';
  let role = null;
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    for (const choice of chunk.choices) {
      if (choice.delta.role) role = choice.delta.role;
      text += choice.delta.content ?? '';
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    if (chunk.usage && chunk.choices.length === 0) usage = chunk.usage;
  }
  assert.equal(role, 'assistant');
  assert.equal(text, expected);
  assert.equal(finish, 'length');
  assert.equal(usage.completion_tokens, 24);
  assert.equal(usage.prompt_tokens, r.usage.prompt_tokens);
  ++checks;

  await assert.rejects(chat.chat.completions.create({ messages: [{ role: 'user' }] }), (e) => {
    assert.ok(e instanceof OpenAI.BadRequestError, String(e));
    assert.equal(e.param, 'messages');
    return true;
  });
  ++checks;
} finally {
  await stopServer(chatSrv);
  rmSync(chatDir, { recursive: true, force: true });
}
console.log(`ok: ${checks} checks against rewind serve on ports ${port} and ${chatSrv.port}`);
